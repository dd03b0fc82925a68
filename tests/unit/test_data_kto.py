"""kto_dataset: labelled completions, their mismatched pairs, bad rows, padded_collate_kto."""

import json

import pytest
import torch

from tunelab._paths import assets_dir
from tunelab.data import IGNORE_INDEX, kto_dataset, load_tokenizer, padded_collate_kto
from tunelab.errors import DataError

ROWS = [
    {"prompt": "Next number after 41:", "completion": "42", "label": True},
    {"prompt": "Sort the letters: c a b", "completion": "c b a", "label": False},
    {"prompt": "Count the words: cup dog", "completion": "2", "label": True},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(assets_dir() / "tiny")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def trained_text(tok, tokens, labels):
    kept = [t for t, label in zip(tokens, labels, strict=True) if label != IGNORE_INDEX]
    return tok.decode(kept, skip_special_tokens=False)


def untrained_text(tok, tokens, labels):
    kept = [t for t, label in zip(tokens, labels, strict=True) if label == IGNORE_INDEX]
    return tok.decode(kept, skip_special_tokens=False)


@pytest.mark.parametrize("template", ["llama3", "auto"])
def test_rows_and_their_mismatched_pairs(tok, tmp_path, template):
    ds = kto_dataset(tok, source=write_jsonl(tmp_path / "k.jsonl", ROWS), template=template)
    assert len(ds) == 3 and ds.num_skipped == 0
    items = [ds[i] for i in range(3)]
    assert [item["desirable"] for item in items] == [True, False, True]
    for i, item in enumerate(items):
        assert "42" not in untrained_text(tok, item["tokens"], item["labels"]) or i != 0
        assert ROWS[i]["completion"] in trained_text(tok, item["tokens"], item["labels"])
        # The mismatched pair: this row's prompt, the previous row's completion (row 0: the last).
        other = items[i - 1]
        prompt_end = next(j for j, lab in enumerate(item["labels"]) if lab != IGNORE_INDEX)
        start = next(j for j, lab in enumerate(other["labels"]) if lab != IGNORE_INDEX)
        assert item["kl_tokens"] == item["tokens"][:prompt_end] + other["tokens"][start:]
        assert item["kl_labels"] == [IGNORE_INDEX] * prompt_end + other["labels"][start:]
        assert ROWS[i]["prompt"] in untrained_text(tok, item["kl_tokens"], item["kl_labels"])
        assert ROWS[i - 1]["completion"] in trained_text(tok, item["kl_tokens"], item["kl_labels"])


def test_messages_layout_equals_prompt_completion(tok, tmp_path):
    conversations = [
        {
            "messages": [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["completion"]},
            ],
            "label": row["label"],
        }
        for row in ROWS
    ]
    by_messages = kto_dataset(tok, source=write_jsonl(tmp_path / "m.jsonl", conversations))
    by_columns = kto_dataset(tok, source=write_jsonl(tmp_path / "p.jsonl", ROWS))
    assert [by_messages[i] for i in range(3)] == [by_columns[i] for i in range(3)]


def test_mismatched_pairs_are_cut_to_max_seq_len(tok, tmp_path):
    # Row 0's long prompt followed by row 1's long (itself cut) completion: past 24 tokens.
    rows = [
        {**ROWS[0], "prompt": "Reverse the words: cup cat bed egg car ring ship hill"},
        {**ROWS[1], "prompt": "x", "completion": " ".join(["b a c"] * 30)},
    ]
    ds = kto_dataset(tok, source=write_jsonl(tmp_path / "k.jsonl", rows), max_seq_len=24)
    assert len(ds[0]["kl_tokens"]) == len(ds[0]["kl_labels"]) == 24
    assert ds.num_truncated == 1


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prompt": "x", "completion": "42"}, r"column 'label': missing label"),
        ({"prompt": "x", "completion": "42", "label": "yes"}, r"column 'label': label must be true or false, got 'yes'"),
        ({"prompt": "x", "completion": "42", "label": 1}, r"column 'label': label must be true or false, got 1"),
        ({"prompt": "x", "completion": "", "label": True}, r"column 'completion': empty text"),
        ({"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}], "label": True}, r"column 'messages': the final message must be the assistant's"),
    ],
)  # fmt: skip
def test_malformed_rows_name_file_line_and_column(tok, tmp_path, bad, message):
    rows = ROWS + [bad]
    if "messages" in bad:  # the messages layout: every row a conversation
        rows = [
            {"messages": [{"role": "user", "content": r["prompt"]},
                          {"role": "assistant", "content": r["completion"]}], "label": r["label"]}
            for r in ROWS
        ] + [bad]  # fmt: skip
    path = write_jsonl(tmp_path / "kto.jsonl", rows)
    with pytest.raises(DataError, match=r"kto\.jsonl:4: row 3 \(0-based\), " + message):
        kto_dataset(tok, source=path, template="llama3")
    ds = kto_dataset(tok, source=path, template="llama3", skip_malformed=True)
    assert len(ds) == 3 and ds.num_skipped == 1


def test_missing_column_and_too_few_rows(tok, tmp_path):
    no_label = [{k: v for k, v in row.items() if k != "label"} for row in ROWS]
    with pytest.raises(DataError, match=r"no column 'label'"):
        kto_dataset(tok, source=write_jsonl(tmp_path / "a.jsonl", no_label))
    with pytest.raises(DataError, match=r"at least 2 usable rows"):
        kto_dataset(tok, source=write_jsonl(tmp_path / "b.jsonl", ROWS[:1]))


def test_collate_is_completions_then_mismatched_pairs(tok, tmp_path):
    ds = kto_dataset(tok, source=write_jsonl(tmp_path / "k.jsonl", ROWS))
    items = [ds[i] for i in range(3)]
    batch = padded_collate_kto(items, pad_id=tok.pad_id)
    assert batch["tokens"].shape[0] == 6 and batch["desirable"].tolist() == [True, False, True]
    for i, item in enumerate(items):
        n, m = len(item["tokens"]), len(item["kl_tokens"])
        assert batch["tokens"][i, :n].tolist() == item["tokens"]
        assert batch["tokens"][3 + i, :m].tolist() == item["kl_tokens"]
        assert batch["labels"][3 + i, m:].eq(IGNORE_INDEX).all()
    assert batch["desirable"].dtype == torch.bool


def test_embedded_tiny_kto_data(tok):
    ds = kto_dataset(tok, source=str(assets_dir() / "tiny" / "kto.jsonl"), template="instruct")
    assert len(ds) == 400 and ds.num_skipped == ds.num_truncated == 0
    assert sum(ds[i]["desirable"] for i in range(len(ds))) == 200
