"""The embedded configs' datasets stay sample for sample what they were.

The recipe golden-loss tests depend on identical samples in an identical order, so any change
to how rows are read, tokenized, cached or packed must leave these digests unchanged. They were
recorded from the first implementation (rows read and tokenized in every rank, in Python
lists) before it was replaced by the Arrow-backed, cached one.
"""

import hashlib
import json

import pytest

from tunelab.cli._check import recipe_of_config
from tunelab.cli._discovery import load_recipe_args
from tunelab.config import instantiate, load_config, parse_args, resolve_config_path

QWEN = "tests/chat_templates/qwen2_5_instruct.jinja"
MISTRAL = "tests/chat_templates/mistral_nemo_instruct.jinja"
# (config, overrides, dataset key) -> (items, skipped, truncated, dropped, digest of the items).
GOLDEN = [
    ("tiny/lora", (), "dataset", (1600, 0, 0, 0, "0aeeb5e53068a30c")),
    ("tiny/lora", (), "val_dataset", (100, 0, 0, 0, "bcc65185b4db0d40")),
    ("tiny/lora", ("dataset.packed=true",), "dataset", (302, 0, 0, 0, "7efaf7f45c0dcf0d")),
    ("tiny/chat_lora", (), "dataset", (300, 0, 0, 0, "01cea49e572efc1d")),
    ("tiny/chat_lora", ("dataset.packed=true", "dataset.max_seq_len=128"), "dataset",
     (114, 0, 0, 0, "67bd2990c632343d")),
    ("tiny/chat_lora", (f"tokenizer.chat_template={QWEN}",), "dataset",
     (300, 0, 0, 0, "7e1eacea876e0d12")),
    # Mistral Nemo's template re-renders earlier turns: one sample per assistant turn.
    ("tiny/chat_lora", (f"tokenizer.chat_template={MISTRAL}",), "dataset",
     (375, 0, 0, 0, "4d2fc250fc01d9a5")),
    ("tiny/lora_dpo", (), "dataset", (400, 0, 0, 0, "a84fe6a3b32ae6dd")),
    ("tiny/lora_dpo", ("dataset.template=auto", "dataset.max_seq_len=24"), "dataset",
     (400, 0, 97, 0, "1f081e2f643af072")),
]  # fmt: skip


def digest(items) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


def build(config, overrides, key):
    path = resolve_config_path(config)
    cfg = load_config(str(path), list(overrides))
    args = parse_args(cfg, load_recipe_args(recipe_of_config(cfg, path)))
    tokenizer = instantiate(args.tokenizer)
    return instantiate(getattr(args, key), tokenizer=tokenizer)


@pytest.mark.parametrize(("config", "overrides", "key", "expected"), GOLDEN)
def test_config_datasets_are_unchanged(config, overrides, key, expected):
    dataset = build(config, overrides, key)
    items = [dataset[i] for i in range(len(dataset))]
    counts = (dataset.num_skipped, dataset.num_truncated, dataset.num_dropped)
    assert (len(dataset), *counts, digest(items)) == expected


def _write_jsonl(path, rows):
    path.write_text(
        "".join(row if isinstance(row, str) else json.dumps(row) + "\n" for row in rows)
    )
    return str(path)


ALPACA = {"instruction": "Reverse the words.", "input": "red cat", "output": "cat red"}
CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Next number after 41:"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "And after 42?"},
        {"role": "assistant", "content": "43"},
    ]
}
PAIR = {"prompt": "Next number after 41:", "chosen": "42", "rejected": "43 44 45 46 47"}


def test_files_with_malformed_rows_are_unchanged(tmp_path):
    from tunelab._paths import assets_dir
    from tunelab.data import (
        chat_dataset,
        instruct_dataset,
        load_tokenizer,
        preference_dataset,
        text_dataset,
    )

    tok = load_tokenizer(assets_dir() / "tiny")
    instruct = _write_jsonl(
        tmp_path / "i.jsonl",
        [ALPACA, "{oops\n", {"instruction": "x", "output": 7}, "\n", {**ALPACA, "input": ""},
         {"instruction": "Count the words.", "output": "2"}, "[1, 2]\n"],
    )  # fmt: skip
    chat = _write_jsonl(
        tmp_path / "c.jsonl",
        [CHAT, {"messages": []}, {"messages": CHAT["messages"][:3]}, {"messages": "hi"}],
    )
    text = tmp_path / "t.txt"
    text.write_text("red cat sun\n\nsort the letters\n")
    pairs = _write_jsonl(
        tmp_path / "p.jsonl",
        [PAIR, {**PAIR, "prompt": "Count " * 30}, {**PAIR, "chosen": ""},
         {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}],
    )  # fmt: skip
    built = [
        instruct_dataset(tok, source=instruct, skip_malformed=True),
        instruct_dataset(tok, source=instruct, skip_malformed=True, template="alpaca", max_seq_len=12, packed=True),
        instruct_dataset(tok, source=instruct, skip_malformed=True, template="auto", train_on_input=True),
        chat_dataset(tok, source=chat, skip_malformed=True),
        chat_dataset(tok, source=chat, skip_malformed=True, template="chatml", train_on_input=True),
        text_dataset(tok, source="text", data_files=str(text), skip_malformed=True),
        preference_dataset(tok, source=pairs, skip_malformed=True, max_seq_len=20),
        preference_dataset(tok, source=pairs, skip_malformed=True, template="llama3"),
    ]  # fmt: skip
    summary = [
        (len(ds), ds.num_skipped, ds.num_truncated, ds.num_dropped,
         digest([ds[i] for i in range(len(ds))]))
        for ds in built
    ]  # fmt: skip
    assert summary == [
        (3, 3, 0, 0, "568f641aba14f006"),
        (3, 3, 3, 0, "c60984a8142cf5c5"),
        (3, 3, 0, 0, "28a1ff1a4c77f816"),
        (2, 2, 0, 0, "abb45880dd274f8a"),
        (2, 2, 0, 0, "58c84ec6d2010715"),
        (2, 1, 0, 0, "92de2c3e127b3be9"),
        (2, 1, 2, 1, "f2e595800ff6af6c"),
        (3, 1, 0, 0, "2bfefb4a0b7fd852"),
    ]
