"""The embedded tiny default: present, small, reproducible, loadable, and a meaningful base."""

import json

import pytest
import torch
from safetensors import safe_open

from tunelab._paths import assets_dir
from tunelab.assets import build_tiny
from tunelab.data import (
    chat_dataset,
    instruct_dataset,
    load_tokenizer,
    preference_dataset,
)

TINY = assets_dir() / "tiny"
TEXT_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "sft.jsonl",
    "sft_val.jsonl",
    "chat.jsonl",
    "preference.jsonl",
    "preference_val.jsonl",
    "kto.jsonl",
    "grpo_prompts.jsonl",
    "tool_calls.jsonl",
    "tools_chat_template.jinja",
]
MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors"]


def read_jsonl(name):
    return [json.loads(line) for line in (TINY / name).read_text().splitlines()]


def test_files_present_and_small():
    sizes = {name: (TINY / name).stat().st_size for name in TEXT_FILES + MODEL_FILES}
    assert sum(sizes.values()) < 4 * 2**20
    assert sizes["model.safetensors"] < 3 * 2**20


def test_generator_reproduces_the_shipped_text_files(tmp_path):
    build_tiny.build_text_assets(tmp_path)
    for name in TEXT_FILES:
        assert (tmp_path / name).read_bytes() == (TINY / name).read_bytes(), name


def test_datasets_load_without_malformed_rows():
    tok = load_tokenizer(TINY)
    sft = instruct_dataset(tok, source=str(TINY / "sft.jsonl"))
    val = instruct_dataset(tok, source=str(TINY / "sft_val.jsonl"))
    chat = chat_dataset(tok, source=str(TINY / "chat.jsonl"), template="llama3")
    pref = preference_dataset(tok, source=str(TINY / "preference.jsonl"), template="instruct")
    assert (len(sft), len(val), len(chat), len(pref)) == (1600, 100, 300, 400)
    assert sft.num_skipped == val.num_skipped == chat.num_skipped == pref.num_skipped == 0
    # Short enough for the tiny configs: every sample fits in 128 tokens.
    assert max(len(item["tokens"]) for item in [*sft, *chat]) <= 128


def test_tool_calls_are_one_sample_per_row_training_calls_not_results():
    tok = load_tokenizer(TINY, chat_template=str(TINY / "tools_chat_template.jinja"))
    tools = chat_dataset(tok, source=str(TINY / "tool_calls.jsonl"), max_seq_len=512)
    assert len(tools) == 300 and tools.num_skipped == 0 and tools.num_truncated == 0
    for item, row in zip(tools, read_jsonl("tool_calls.jsonl")):
        trained = tok.decode([t for t in item["labels"] if t != -100], skip_special_tokens=False)
        messages = row["messages"]
        call_turn = next(m for m in messages if m.get("tool_calls"))
        for call in call_turn["tool_calls"]:
            assert call["function"]["arguments"] in trained  # every call is trained
        assert trained.endswith(messages[-1]["content"] + "<|im_end|>")  # and the answer
        assert trained.count("<|im_end|>") == 2  # the two assistant turns, no tool turn
        assert ("<think>" in trained) == ("reasoning_content" in call_turn)


def test_data_carries_the_rules():
    train = {(r["instruction"], r["input"]) for r in read_jsonl("sft.jsonl")}
    val = read_jsonl("sft_val.jsonl")
    assert not train & {(r["instruction"], r["input"]) for r in val}  # disjoint splits
    for row in read_jsonl("sft.jsonl")[:200]:
        words = row["input"].split()
        if row["instruction"] == "Reverse the words.":
            assert row["output"].split() == words[::-1]
        elif row["instruction"] == "Sort the letters.":
            assert row["output"].split() == sorted(words)
        elif row["instruction"] == "Count the words.":
            assert row["output"] == str(len(words))
        elif row["input"]:
            assert int(row["output"]) == int(row["input"]) + 1
    assert all(r["chosen"] != r["rejected"] for r in read_jsonl("preference.jsonl"))


def test_model_is_hf_llama_with_tied_embeddings():
    config = json.loads((TINY / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"]) == (128, 3)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["vocab_size"] == load_tokenizer(TINY).vocab_size
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert "lm_head.weight" not in keys
    assert "model.layers.2.self_attn.k_proj.weight" in keys and len(keys) == 1 + 3 * 9 + 1


def test_base_model_learned_the_generic_text():
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    tok = load_tokenizer(TINY)
    ids = torch.tensor([tok.encode("41 42 43 44 45 46 47 48 49 50 51 52")])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    # Uniform guessing over 810 ids costs ln(810) = 6.7 nats per token.
    assert loss < 3.0  # measured 2.28 after the 400 pretraining steps
