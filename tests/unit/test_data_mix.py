"""Weighted mixing: proportions, determinism, whole passes, config nesting, bad arguments."""

from collections import Counter

import pytest

from tunelab._paths import assets_dir
from tunelab.config import instantiate
from tunelab.data import DatasetSpec, MixedDataset, chat_dataset, load_tokenizer, mix_dataset
from tunelab.errors import ConfigError

TINY = assets_dir() / "tiny"


class Items:
    """A dataset of labelled items: ``(name, index)``."""

    def __init__(self, name, length, kind="sft", packed=False):
        self.name, self.length, self.kind, self.packed = name, length, kind, packed
        self.num_skipped, self.num_truncated, self.num_dropped = 1, 2, 0

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return (self.name, index)


def test_counts_follow_the_weights_and_add_up():
    mixed = MixedDataset([Items("a", 100), Items("b", 50), Items("c", 10)], [0.5, 0.3, 0.2])
    assert len(mixed) == 160 and mixed.counts == [80, 48, 32]
    drawn = Counter(name for name, _ in (mixed[i] for i in range(len(mixed))))
    assert drawn == {"a": 80, "b": 48, "c": 32}
    # Largest remainder: 10 items as 1/3 each is 4, 3, 3 (the tie goes to the first).
    assert MixedDataset([Items("a", 5)] * 3, [1, 1, 1], num_samples=10).counts == [4, 3, 3]
    assert mixed.num_skipped == 3 and mixed.num_truncated == 6


def test_whole_passes_when_upsampling_and_a_subset_when_downsampling():
    mixed = MixedDataset([Items("small", 3), Items("big", 100)], [1, 1], num_samples=20)
    drawn = [mixed[i] for i in range(len(mixed))]
    small = Counter(index for name, index in drawn if name == "small")
    # 10 draws from 3 items: three whole passes and one more item.
    assert sorted(small.values()) == [3, 3, 4]
    big = [index for name, index in drawn if name == "big"]
    assert len(big) == len(set(big)) == 10


def test_deterministic_from_the_seed():
    def draw(seed):
        mixed = MixedDataset([Items("a", 30), Items("b", 30)], [2, 1], seed=seed)
        return [mixed[i] for i in range(len(mixed))]

    assert draw(0) == draw(0) and draw(0) != draw(1)
    # Interleaved, not one dataset after the other.
    names = [name for name, _ in draw(0)]
    assert names[:20].count("b") > 0


def test_bad_arguments():
    with pytest.raises(ConfigError, match="one weight per dataset"):
        MixedDataset([Items("a", 3)], [1, 1])
    with pytest.raises(ConfigError, match="weights must be >= 0 and not all 0"):
        MixedDataset([Items("a", 3), Items("b", 3)], [1, -1])
    with pytest.raises(ConfigError, match="weights must be >= 0 and not all 0"):
        MixedDataset([Items("a", 3)], [0])
    with pytest.raises(ConfigError, match="same kind of item"):
        MixedDataset([Items("a", 3), Items("b", 3, kind="preference")], [1, 1])
    with pytest.raises(ConfigError, match="same kind of item"):
        MixedDataset([Items("a", 3), Items("b", 3, packed=True)], [1, 1])
    with pytest.raises(ConfigError, match="num_samples must be at least 1"):
        MixedDataset([Items("a", 3)], [1], num_samples=0)
    with pytest.raises(ConfigError, match="dataset 1 has no items"):
        MixedDataset([Items("a", 3), Items("b", 0)], [1, 1])


def test_config_nodes_are_built_with_the_recipe_tokenizer():
    tok = load_tokenizer(TINY, max_seq_len=128)
    node = {
        "_component_": "tunelab.data.mix_dataset",
        "weights": [1, 1],
        "num_samples": 50,
        "datasets": [
            {"_component_": "tunelab.data.chat_dataset", "source": str(TINY / "chat.jsonl")},
            {
                "_component_": "tunelab.data.instruct_dataset",
                "source": str(TINY / "sft.jsonl"),
                "template": "auto",
            },
        ],
    }
    mixed = instantiate(node, tokenizer=tok)
    assert len(mixed) == 50 and mixed.counts == [25, 25]
    chat = chat_dataset(tok, source=str(TINY / "chat.jsonl"))
    assert all(mixed[i] == chat[mixed._index[i]] for i in range(50) if mixed._which[i] == 0)
    # Without a tokenizer a builder waits for one; nested mixtures do too.
    spec = chat_dataset(source=str(TINY / "chat.jsonl"), max_seq_len=64)
    assert isinstance(spec, DatasetSpec) and spec.kwargs["max_seq_len"] == 64
    nested = mix_dataset(datasets=[spec], weights=[1])
    assert isinstance(nested, DatasetSpec)
    outer = mix_dataset(tok, datasets=[nested, spec], weights=[1, 3], num_samples=8)
    assert outer.counts == [2, 6]
