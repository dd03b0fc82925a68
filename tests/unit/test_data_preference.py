"""Preference datasets: prompt masking, strings or messages, truncation report, bad rows."""

import json

import pytest

from tunelab._paths import assets_dir
from tunelab.data import (
    IGNORE_INDEX,
    Message,
    load_tokenizer,
    preference_dataset,
    tokenize_messages,
)
from tunelab.errors import DataError

PAIR = {"prompt": "Next number after 41:", "chosen": "42", "rejected": "43"}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(assets_dir() / "tiny")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def trained_text(tok, tokens, labels):
    return tok.decode(
        [t for t, label in zip(tokens, labels) if label != IGNORE_INDEX], skip_special_tokens=False
    )


def test_string_pair(tok, tmp_path):
    ds = preference_dataset(
        tok, source=write_jsonl(tmp_path / "p.jsonl", [PAIR]), template="llama3"
    )
    item = ds[0]
    ids, _ = tokenize_messages(
        tok, [Message("user", PAIR["prompt"], True), Message("assistant", "42")], "llama3"
    )
    assert item["chosen_tokens"] == ids
    assert trained_text(tok, item["chosen_tokens"], item["chosen_labels"]) == "42<|eot_id|>"
    assert trained_text(tok, item["rejected_tokens"], item["rejected_labels"]) == "43<|eot_id|>"
    assert (ds.num_skipped, ds.num_truncated, ds.num_dropped) == (0, 0, 0)


def test_message_lists_and_column_map(tok, tmp_path):
    row = {
        "question": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": PAIR["prompt"]},
        ],
        "good": [{"role": "assistant", "content": "42"}],
        "bad": "41",
    }
    ds = preference_dataset(
        tok, source=write_jsonl(tmp_path / "p.jsonl", [row]), template="chatml",
        column_map={"prompt": "question", "chosen": "good", "rejected": "bad"},
    )  # fmt: skip
    item = ds[0]
    assert tok.decode(item["chosen_tokens"], skip_special_tokens=False).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nNext number"
    )
    assert trained_text(tok, item["chosen_tokens"], item["chosen_labels"]) == "42<|im_end|>"
    assert trained_text(tok, item["rejected_tokens"], item["rejected_labels"]) == "41<|im_end|>"


def test_truncation_keeps_the_prompt_start_and_reports(tok, tmp_path):
    long = {"prompt": "Reverse the words: red cat", "chosen": "cat red " * 6, "rejected": "no"}
    path = write_jsonl(tmp_path / "p.jsonl", [PAIR, long])
    full = preference_dataset(tok, source=path)
    prompt_len = next(i for i, x in enumerate(full[1]["chosen_labels"]) if x != IGNORE_INDEX)
    max_len = prompt_len + 3
    assert len(full[0]["chosen_tokens"]) <= max_len < len(full[1]["chosen_tokens"])
    cut = preference_dataset(tok, source=path, max_seq_len=max_len)
    assert cut.num_truncated == 1 and cut.num_dropped == 0 and len(cut) == 2
    assert cut[1]["chosen_tokens"] == full[1]["chosen_tokens"][:max_len]
    assert cut[1]["rejected_tokens"] == full[1]["rejected_tokens"]  # short side untouched
    assert cut[0] == full[0]


def test_pairs_without_completion_after_truncation_are_dropped(tok, tmp_path):
    long_prompt = {
        "prompt": "Reverse the words: " + "red cat " * 20,
        "chosen": "a",
        "rejected": "b",
    }
    path = write_jsonl(tmp_path / "p.jsonl", [PAIR, long_prompt])
    ds = preference_dataset(tok, source=path, max_seq_len=20)
    assert len(ds) == 1 and ds.num_truncated == 1 and ds.num_dropped == 1
    with pytest.raises(DataError, match="leaves no completion token in any pair"):
        preference_dataset(tok, source=path, max_seq_len=3)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prompt": "x", "chosen": "42"}, r"column 'rejected': missing value"),
        ({"prompt": "x", "chosen": "", "rejected": "1"}, r"column 'chosen': empty text"),
        ({"prompt": 5, "chosen": "4", "rejected": "1"}, r"column 'prompt': expected a list of messages, got int"),
        ({"prompt": "x", "chosen": [], "rejected": "1"}, r"column 'chosen': empty conversation"),
        ({"prompt": "x", "chosen": [{"role": "user", "content": "4"}], "rejected": "1"}, r"column 'chosen': no assistant message"),
    ],
)  # fmt: skip
def test_malformed_pairs(tok, tmp_path, bad, message):
    path = write_jsonl(tmp_path / "pref.jsonl", [PAIR, PAIR, bad])
    with pytest.raises(DataError, match=r"pref\.jsonl:3: row 2 \(0-based\), " + message):
        preference_dataset(tok, source=path)
    ds = preference_dataset(tok, source=path, skip_malformed=True)
    assert len(ds) == 2 and ds.num_skipped == 1
