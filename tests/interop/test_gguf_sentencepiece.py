"""llama.cpp runs tunelab's GGUF export of a model with a SentencePiece-style tokenizer.

Llama 2, Mistral, Gemma and Phi-3 ship ``tokenizer.json`` BPE models with byte fallback and
spaces written as ``▁``, which the GGUF file carries as llama.cpp's ``llama`` vocabulary
(scores, byte tokens). A tiny such tokenizer (``build_sentencepiece_tokenizer``) with a tiny
Mistral model is exported once per layout: Llama 2's (a ``▁`` put before the text) and Gemma's
(none).
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
from tunelab.checkpoint.gguf_export import export_gguf
from tunelab.models import load_pretrained

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
LAYOUTS = {"llama2": True, "gemma": False}  # layout -> a ▁ put before the text


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Layout -> (model folder, its f16 GGUF, transformers' tokenizer), made once."""
    root, result = tmp_path_factory.mktemp("gguf_spm"), {}
    for layout, prefix in LAYOUTS.items():
        folder = root / layout / "epoch_0"
        vocab = build_sentencepiece_tokenizer(folder, space_prefix=prefix)
        if layout == "llama2":
            ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
            model = build_tiny_hf_model("mistral", vocab_size=vocab, sliding_window=None, **ids)
            model.save_pretrained(folder)
        else:  # the same weights: only the tokenizer differs
            for file in root.glob("llama2/epoch_0/*.json"):
                if not file.name.startswith("tokenizer"):
                    shutil.copy(file, folder)
            shutil.copy(root / "llama2/epoch_0/model.safetensors", folder)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        result[layout] = (folder, export_gguf(folder, quant="f16"), tokenizer)
    return result


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_ids_equal_transformers(exported, layout):
    _, path, hf_tokenizer = exported[layout]
    model = llama(path, vocab_only=True)
    assert model.metadata["tokenizer.ggml.model"] == "llama"
    for text in TEXTS + SPECIAL_TEXTS:
        ours = model.tokenize(text.encode(), add_bos=True, special=True)
        assert ours == hf_tokenizer(text)["input_ids"], (layout, text)


def test_llama_cpp_logits_and_greedy_equal_tunelab(exported):
    folder, path, hf_tokenizer = exported["llama2"]
    ours, theirs = load_pretrained(folder, dtype=torch.float32), llama(path)
    for prompt in SPM_PROMPTS:
        ids = prompt_ids(hf_tokenizer, prompt)
        assert ids == theirs.tokenize(prompt.encode(), add_bos=True, special=True), prompt
        difference = np.abs(llama_logits(theirs, ids) - tunelab_logits(ours, ids)).max()
        assert difference < 1e-2, (prompt, difference)
        assert llama_greedy(theirs, ids) == tunelab_greedy(ours, ids), prompt
