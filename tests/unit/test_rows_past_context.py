"""SFT and preference samples longer than the model's context are counted and reported
(issue 38, finding 4): before, they trained silently on positions the model never saw."""

import json
import logging

import pytest

from tunelab import _paths
from tunelab.data import MixedDataset, load_tokenizer, preference_dataset, text_dataset
from tunelab.training.session import report_past_context

TINY = _paths.assets_dir() / "tiny"
CONTEXT = 512  # the tiny model's max_position_embeddings


@pytest.fixture
def tokenizer():
    return load_tokenizer(str(TINY))


def _words(count: int) -> str:
    return " ".join(f"w{i}" for i in range(count))


@pytest.fixture
def records(caplog):
    logging.getLogger("tunelab").propagate = True  # the recipes' handler may have stopped it
    caplog.set_level(logging.INFO, logger="tunelab")
    return caplog


def test_text_samples_past_the_context_are_counted_and_logged(tmp_path, tokenizer, records):
    path = tmp_path / "text.jsonl"
    lines = [{"text": _words(900)}, {"text": "short"}, {"text": _words(2000)}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    dataset = text_dataset(tokenizer, source=str(path), cache_dir=str(tmp_path / "cache"))
    lengths = [len(dataset[i]["tokens"]) for i in range(len(dataset))]
    assert sorted(length > CONTEXT for length in lengths) == [False, True, True]
    assert dataset.num_longer_than(CONTEXT) == 2
    assert report_past_context(dataset, "dataset", CONTEXT) == 2
    assert (
        "dataset: 2 samples are longer than the model's context (max_position_embeddings 512) "
        "and train on positions past it; set dataset.max_seq_len (or tokenizer.max_seq_len) to "
        "512 or less to cut them" in records.text
    )
    # A cut at the context leaves none; nothing is said then.
    cut = text_dataset(
        tokenizer, source=str(path), max_seq_len=CONTEXT, cache_dir=str(tmp_path / "cache")
    )
    records.clear()
    assert report_past_context(cut, "dataset", CONTEXT) == 0 and records.text == ""
    mixed = MixedDataset([dataset, cut], [1.0, 1.0])
    assert report_past_context(mixed, "dataset", CONTEXT) == 2


def test_preference_pairs_past_the_context_are_counted(tmp_path, tokenizer):
    path = tmp_path / "pairs.jsonl"
    pairs = [
        {"prompt": "p", "chosen": _words(700), "rejected": "no"},
        {"prompt": "p", "chosen": "yes", "rejected": "no"},
    ]
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    dataset = preference_dataset(
        tokenizer, source=str(path), template="chatml", cache_dir=str(tmp_path / "cache")
    )
    assert dataset.num_longer_than(CONTEXT) == 1
    assert report_past_context(dataset, "val_dataset", None) == 0  # no context: not checked
