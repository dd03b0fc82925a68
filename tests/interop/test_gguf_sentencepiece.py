"""llama.cpp runs tunelab's GGUF export of a model with a SentencePiece-style tokenizer.

Llama 2, Mistral, Gemma and Phi-3 ship ``tokenizer.json`` BPE models with byte fallback and
spaces written as ``▁``, which the GGUF file carries as llama.cpp's ``llama`` vocabulary
(scores, byte tokens). A tiny such tokenizer (``build_sentencepiece_tokenizer``) with a tiny
Mistral model is exported once per layout: Llama 2's (a ``▁`` put before the text), Gemma's
(none) and Phi-3's (Llama 2's, with added tokens that strip the whitespace after them).
"""

import shutil

import numpy as np
import pytest
import torch

from tests.conftest import build_tiny_hf_model
from tests.gguf_checks import (
    SPM_ADDED,
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
        build_sentencepiece_tokenizer(folders[layout], space_prefix=prefix, phi3=phi3)
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
