"""The tunelab tokenizer and templates give the ids transformers gives on the same files."""

import json
import shutil

import pytest

from tunelab._paths import assets_dir
from tunelab.data import Message, load_tokenizer, tokenize_messages

transformers = pytest.importorskip("transformers")

TINY = assets_dir() / "tiny"
STRINGS = [
    "hello world",
    "Reverse the words: red cat sun",
    "<|begin_of_text|>already has bos",
    "a<|eot_id|>b<|im_start|>user\nhi<|im_end|>",
    "<|start_header_id|>assistant<|end_header_id|>\n\n42<|eot_id|>",
    "  leading and   inner spaces\n\n\nnewlines\t tab",
    "digits 1234567 and 3.14 and -7",
    "unicode: héllo ☃ 日本語 🙂",
    "",
]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Sort the letters: d a c"},
    {"role": "assistant", "content": "a c d"},
    {"role": "user", "content": "Next number after 41:"},
    {"role": "assistant", "content": "42"},
]


def hf_ids(encoding):
    return list(encoding["input_ids"] if hasattr(encoding, "keys") else encoding)


@pytest.fixture(scope="module")
def hf_tok():
    return transformers.AutoTokenizer.from_pretrained(TINY)


@pytest.mark.parametrize("text", STRINGS)
def test_encode_matches_autotokenizer(hf_tok, text):
    tok = load_tokenizer(TINY)
    assert tok.encode(text) == hf_tok(text)["input_ids"]
    assert tok.encode(text, add_bos=False) == hf_tok(text, add_special_tokens=False)["input_ids"]
    ids = tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)


def test_special_ids_match(hf_tok):
    tok = load_tokenizer(TINY)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        hf_tok.bos_token_id,
        hf_tok.eos_token_id,
        hf_tok.pad_token_id,
    )
    assert tok.vocab_size == len(hf_tok)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_llama3_template_matches_apply_chat_template(hf_tok, add_generation_prompt):
    tok = load_tokenizer(TINY)
    conversation = CONVERSATION[:-1] if add_generation_prompt else CONVERSATION
    messages = [Message(m["role"], m["content"]) for m in conversation]
    ours, _ = tokenize_messages(
        tok, messages, "llama3", add_generation_prompt=add_generation_prompt
    )
    theirs = hf_tok.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    assert ours == hf_ids(theirs)


def test_chatml_template_matches_apply_chat_template(hf_tok):
    tok = load_tokenizer(TINY)
    ours, _ = tokenize_messages(
        tok, [Message(m["role"], m["content"]) for m in CONVERSATION], "chatml"
    )
    theirs = hf_tok.apply_chat_template(CONVERSATION, chat_template=CHATML_TEMPLATE, tokenize=True)
    assert ours == hf_ids(theirs)


def test_qwen_style_config_without_bos(tmp_path):
    # Qwen2 ships bos_token: null and a post-processor that adds nothing.
    shutil.copy(TINY / "tokenizer.json", tmp_path / "tokenizer.json")
    raw = json.loads((tmp_path / "tokenizer.json").read_text())
    raw["post_processor"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|pad|>",
            }
        )
    )
    tok = load_tokenizer(tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.bos_id is None and tok.eos_id == hf_tok.eos_token_id
    for text in STRINGS:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
