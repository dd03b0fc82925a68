"""Packing (positions, document ids, padded tail) and the collate functions."""

import json

import pytest
import torch

from tunelab._paths import assets_dir
from tunelab.data import (
    instruct_dataset,
    load_tokenizer,
    pack_samples,
    padded_collate_dpo,
    padded_collate_sft,
)
from tunelab.data.preference import IndexedPairs
from tunelab.errors import ConfigError

SAMPLES = [
    {"tokens": [10, 11, 12], "labels": [-100, 11, 12]},
    {"tokens": [20, 21, 22, 23], "labels": [-100, -100, 22, 23]},
    {"tokens": [30, 31], "labels": [-100, 31]},
    {"tokens": [40, 41, 42, 43, 44, 45, 46, 47], "labels": [-100, 41, 42, 43, 44, 45, 46, 47]},
]


def test_pack_greedy_in_order_with_padded_tail():
    packs = pack_samples(SAMPLES, max_seq_len=8, pad_id=0)
    assert len(packs) == 3
    # [3 + 4] fits in 8; adding the 2-token sample would not, so it starts the next pack.
    assert packs[0] == {
        "tokens": [10, 11, 12, 20, 21, 22, 23, 0],
        "labels": [-100, 11, 12, -100, -100, 22, 23, -100],
        "input_pos": [0, 1, 2, 0, 1, 2, 3, 0],
        "document_ids": [0, 0, 0, 1, 1, 1, 1, 2],
    }
    assert packs[1] == {
        "tokens": [30, 31, 0, 0, 0, 0, 0, 0],
        "labels": [-100, 31] + [-100] * 6,
        "input_pos": [0, 1, 0, 1, 2, 3, 4, 5],
        "document_ids": [0, 0, 1, 1, 1, 1, 1, 1],
    }
    assert packs[2]["tokens"] == SAMPLES[3]["tokens"]  # exactly full: no padding
    assert packs[2]["document_ids"] == [0] * 8 and packs[2]["input_pos"] == list(range(8))


def test_packed_dataset_truncates_long_samples(tmp_path):
    tok = load_tokenizer(assets_dir() / "tiny")
    rows = [
        {"instruction": "Reverse the words.", "input": "red cat sun", "output": "sun cat red"}
    ] * 3
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    unpacked = instruct_dataset(tok, source=str(path))
    length = len(unpacked[0]["tokens"])
    ds = instruct_dataset(tok, source=str(path), packed=True, max_seq_len=2 * length + 3)
    assert ds.packed and len(ds) == 2
    assert ds[0]["tokens"][: 2 * length] == unpacked[0]["tokens"] * 2
    assert ds[0]["tokens"][2 * length :] == [tok.pad_id] * 3
    assert ds[0]["input_pos"][length - 1 : length + 1] == [length - 1, 0]
    cut = instruct_dataset(tok, source=str(path), packed=True, max_seq_len=10)
    assert cut.num_truncated == 3 and len(cut) == 3
    assert cut[0]["tokens"] == unpacked[0]["tokens"][:10]
    with pytest.raises(ConfigError, match="packed: true needs max_seq_len"):
        instruct_dataset(tok, source=str(path), packed=True)


def test_collate_sft_right_pads():
    batch = padded_collate_sft(SAMPLES[:3], pad_id=7)
    assert batch["tokens"].dtype == torch.long and batch["tokens"].shape == (3, 4)
    assert batch["tokens"].tolist() == [[10, 11, 12, 7], [20, 21, 22, 23], [30, 31, 7, 7]]
    assert batch["labels"].tolist() == [
        [-100, 11, 12, -100],
        [-100, -100, 22, 23],
        [-100, 31, -100, -100],
    ]
    assert set(batch) == {"tokens", "labels", "token_mask"}
    assert batch["token_mask"].tolist() == [
        [True, True, True, False],
        [True, True, True, True],
        [True, True, False, False],
    ]
    labels = padded_collate_sft(SAMPLES[:2], pad_id=0, ignore_index=-1)["labels"]
    assert labels[0].tolist() == [-100, 11, 12, -1]


def test_collate_sft_stacks_packs():
    packs = pack_samples(SAMPLES, max_seq_len=8, pad_id=0)
    batch = padded_collate_sft(packs[:2], pad_id=0)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "tokens": (2, 8),
        "labels": (2, 8),
        "token_mask": (2, 8),
        "input_pos": (2, 8),
        "document_ids": (2, 8),
    }
    assert batch["input_pos"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert batch["document_ids"][1].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    # Packs of different lengths: the extra columns get their own document.
    short = pack_samples(SAMPLES[2:3], max_seq_len=3, pad_id=0)
    mixed = padded_collate_sft([packs[0], short[0]], pad_id=0)
    assert mixed["document_ids"][1].tolist() == [0, 0, 1, 2, 2, 2, 2, 2]
    assert mixed["input_pos"][1].tolist() == [0, 1, 0, 3, 4, 5, 6, 7]
    assert mixed["token_mask"][1].tolist() == [True] * 3 + [False] * 5


DPO_PAIRS = [
    {"chosen_tokens": [1, 2, 3], "chosen_labels": [-100, 2, 3],
     "rejected_tokens": [1, 2, 4, 5], "rejected_labels": [-100, 2, 4, 5]},
    {"chosen_tokens": [6, 7], "chosen_labels": [-100, 7],
     "rejected_tokens": [6, 8], "rejected_labels": [-100, 8]},
    {"chosen_tokens": [9], "chosen_labels": [9],
     "rejected_tokens": [9, 9], "rejected_labels": [9, 9]},
]  # fmt: skip


def test_collate_dpo_chosen_then_rejected():
    batch = padded_collate_dpo(DPO_PAIRS[:2], pad_id=0)
    assert set(batch) == {"tokens", "labels"}  # no pair_index without IndexedPairs
    assert batch["tokens"].tolist() == [[1, 2, 3, 0], [6, 7, 0, 0], [1, 2, 4, 5], [6, 8, 0, 0]]
    assert batch["labels"].tolist() == [
        [-100, 2, 3, -100],
        [-100, 7, -100, -100],
        [-100, 2, 4, 5],
        [-100, 8, -100, -100],
    ]


def test_collate_dpo_pair_index_from_indexed_pairs():
    indexed = IndexedPairs(DPO_PAIRS)
    assert len(indexed) == 3
    order = [2, 0]  # a sampler's order
    batch = padded_collate_dpo([indexed[i] for i in order], pad_id=0)
    plain = padded_collate_dpo([DPO_PAIRS[i] for i in order], pad_id=0)
    assert batch["pair_index"].dtype == torch.long
    assert batch["pair_index"].tolist() == order
    # The rest of the batch is what it is without the index.
    assert torch.equal(batch["tokens"], plain["tokens"])
    assert torch.equal(batch["labels"], plain["labels"])
