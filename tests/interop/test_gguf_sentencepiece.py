"""llama.cpp runs tunelab's GGUF export of a model with a SentencePiece-style tokenizer.

Llama 2, Mistral, Gemma and Phi-3 ship ``tokenizer.json`` BPE models with byte fallback and
spaces written as ``▁``, which the GGUF file carries as llama.cpp's ``llama`` vocabulary
(scores, byte tokens). A tiny such tokenizer (``build_sentencepiece_tokenizer``) with a tiny
Mistral model is exported once per layout: Llama 2's (a ``▁`` put before the text), Gemma's
(none) and Phi-3's (Llama 2's, with added tokens that strip the whitespace after them).
"""

import re
import shutil

import numpy as np
import pytest
import torch

from tests.conftest import build_tiny_hf_model
from tests.gguf_checks import (
    PHI3_ADDED,
    SPM_ADDED,
    SPM_CHAT_TEMPLATES,
    SPM_SPECIALS,
    TEXTS,
    build_sentencepiece_tokenizer,
    llama,
    llama_greedy,
    llama_logits,
    prompt_ids,
    tunelab_greedy,
    tunelab_logits,
)
from tunelab.checkpoint import gguf_export
from tunelab.checkpoint.gguf_export import export_gguf
from tunelab.data.tokenizer import load_tokenizer
from tunelab.models import load_pretrained

pytestmark = pytest.mark.slow  # three exports and a control export: over 20 s
pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")

# TEXTS' special tokens are Llama 3's (plain text here); these are this tokenizer's.
SPECIAL_TEXTS = [
    *SPM_SPECIALS, *SPM_ADDED, "a</s>b", "x <s> y", "<start_of_turn>user\nHi<end_of_turn>\n",
    "<end_of_turn><start_of_turn>", " x  y   z", "\u2581 already \u2581\u2581 marked",
]  # fmt: skip
SPM_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Question: what is 2 + 3?\nAnswer: 5, naïve 日本",
    "<start_of_turn>user\nReverse the words: ship milk<end_of_turn>\n<start_of_turn>model\n",
)
# Layout -> (a ▁ put before the text, Phi-3's added tokens that strip the space after them).
LAYOUTS = {"llama2": (True, False), "gemma": (False, False), "phi3": (True, True)}
PHI3_TEXTS = [
    "<|user|>\nHi there<|end|>\n<|assistant|>\n Hello", "<|end|>   x", "</s> y", "<s> z",
    "<|endoftext|> keep", "a <|user|>\t\n b",
]  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Layout -> (model folder, its f16 GGUF, transformers' tokenizer), made once."""
    root, result = tmp_path_factory.mktemp("gguf_spm"), {}
    folders = {layout: root / layout / "epoch_0" for layout in LAYOUTS}
    vocab = max(
        build_sentencepiece_tokenizer(
            folders[layout], prefix, phi3, chat_template=SPM_CHAT_TEMPLATES[layout]
        )
        for layout, (prefix, phi3) in LAYOUTS.items()
    )
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    model = build_tiny_hf_model("mistral", vocab_size=vocab, sliding_window=None, **ids)
    for layout, folder in folders.items():  # the same weights: only the tokenizer differs
        model.save_pretrained(folder)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        result[layout] = (folder, export_gguf(folder, quant="f16"), tokenizer)
    return result


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_ids_equal_transformers(exported, layout):
    _, path, hf_tokenizer = exported[layout]
    model = llama(path, vocab_only=True)
    assert model.metadata["tokenizer.ggml.model"] == "llama"
    for text in TEXTS + (PHI3_TEXTS if layout == "phi3" else SPECIAL_TEXTS):
        ours = model.tokenize(text.encode(), add_bos=True, special=True)
        assert ours == hf_tokenizer(text)["input_ids"], (layout, text)


def test_phi3_added_tokens_get_llama_cpps_phi3_name(exported, tmp_path, monkeypatch):
    """llama.cpp strips the whitespace after special tokens only for a general.name containing
    phi3: Phi-3's tokenizer flags (rstrip) get the name "phi3-epoch_0", and without it (the
    control) llama.cpp keeps the whitespace transformers strips."""
    folder, path, hf_tokenizer = exported["phi3"]
    assert llama(path, vocab_only=True).metadata["general.name"] == "phi3-epoch_0"
    monkeypatch.setattr(gguf_export, "model_name", lambda name, added: name)
    plain = tmp_path / "epoch_0"
    shutil.copytree(folder, plain, ignore=shutil.ignore_patterns("gguf"))
    model = llama(export_gguf(plain, quant="f16"), vocab_only=True)
    differ = [
        text for text in PHI3_TEXTS
        if model.tokenize(text.encode(), add_bos=True, special=True) != hf_tokenizer(text)["input_ids"]
    ]  # fmt: skip
    assert len(differ) >= 3, differ


def test_llama_cpp_logits_and_greedy_equal_tunelab(exported):
    folder, path, hf_tokenizer = exported["llama2"]
    ours, theirs = load_pretrained(folder, dtype=torch.float32), llama(path)
    for prompt in SPM_PROMPTS:
        ids = prompt_ids(hf_tokenizer, prompt)
        assert ids == theirs.tokenize(prompt.encode(), add_bos=True, special=True), prompt
        difference = np.abs(llama_logits(theirs, ids) - tunelab_logits(ours, ids)).max()
        assert difference < 1e-2, (prompt, difference)
        assert llama_greedy(theirs, ids) == tunelab_greedy(ours, ids), prompt


# The tokenizer class each layout's models name in their tokenizer_config.json on the hub.
HUB_CLASSES = {"llama2": "LlamaTokenizer", "gemma": "GemmaTokenizer", "phi3": "LlamaTokenizer"}


def _prefix_dropped(text: str, specials: tuple[str, ...]) -> bool:
    """Whether transformers 5's LlamaTokenizer puts no ▁ where tokenizer.json's Prepend
    normalizer puts one: before text that starts with a space or ▁ (its Metaspace
    pre-tokenizer, prepend_scheme "first", adds none there) or before any text that follows a
    special token (it adds one to the first piece of text only)."""
    parts = [p for p in re.split("(" + "|".join(map(re.escape, specials)) + ")", text) if p]
    first = next((i for i, part in enumerate(parts) if part in specials), len(parts))
    return text.startswith((" ", "▁")) or any(p not in specials for p in parts[first + 1 :])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_ids_under_the_hubs_tokenizer_class(exported, layout):
    """llama.cpp gives tunelab's ids (tokenizer.json's, which training used) on every string,
    and transformers' under the class the hub's models name (LlamaTokenizer for Llama 2,
    Mistral and Phi-3, GemmaTokenizer for Gemma) on every string but those transformers 5's
    LlamaTokenizer tokenizes apart from tokenizer.json: it replaces the file's pipeline with its
    own (``_prefix_dropped``; huggingface/transformers#47700 describes it)."""
    folder, path, _ = exported[layout]
    hub = getattr(transformers, HUB_CLASSES[layout]).from_pretrained(folder)
    ours, model = load_tokenizer(folder), llama(path, vocab_only=True)
    texts = TEXTS + (PHI3_TEXTS if layout == "phi3" else SPECIAL_TEXTS)
    specials = SPM_SPECIALS + (PHI3_ADDED if layout == "phi3" else SPM_ADDED)
    differ = []
    for text in texts:
        ids = model.tokenize(text.encode(), add_bos=True, special=True)
        assert ids == ours.encode(text), (layout, text)
        if ids != hub(text)["input_ids"]:
            differ.append(text)
    llama_class = HUB_CLASSES[layout] == "LlamaTokenizer"
    assert differ == [t for t in texts if llama_class and _prefix_dropped(t, specials)]


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": " Hello. "},
    {"role": "user", "content": "Bye"},
]


def llama_cpp_render(template: str, messages: list[dict[str, str]]) -> str:
    """llama.cpp's own rendering of ``messages`` (its C++ formats, chosen by the template's
    text: what llama-server and llama-cli use without --jinja), with the generation prompt."""
    import ctypes

    import llama_cpp

    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages]
    )
    size = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(chat), True, None, 0)
    assert size >= 0, "llama.cpp recognises no chat format in the template"
    buffer = ctypes.create_string_buffer(size + 1)
    llama_cpp.llama_chat_apply_template(template.encode(), chat, len(chat), True, buffer, size + 1)
    return buffer.raw[:size].decode()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chat_template_renders_as_transformers(exported, layout):
    """The GGUF carries the chat template; llama-cpp-python's Jinja renderer gives transformers'
    prompt, and so does llama.cpp's own C++ renderer after the BOS its tokenizer adds (for
    Llama 2's format, the first turn only: llama.cpp writes later turns without the spaces
    around the answer and without their BOS)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    _, path, hf_tokenizer = exported[layout]
    model = llama(path, vocab_only=True)
    template = model.metadata["tokenizer.chat_template"]
    assert template == SPM_CHAT_TEMPLATES[layout]
    expected = hf_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    jinja = Jinja2ChatFormatter(template, eos_token="</s>", bos_token="<s>",
                                add_generation_prompt=True)  # fmt: skip
    assert jinja(messages=CONVERSATION).prompt == expected
    ids = model.tokenize(expected.encode(), add_bos=False, special=True)
    assert ids == hf_tokenizer(expected, add_special_tokens=False)["input_ids"]
    turns = CONVERSATION[:2] if layout == "llama2" else CONVERSATION
    expected = hf_tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert expected.removeprefix("<s>") == llama_cpp_render(template, turns), layout
