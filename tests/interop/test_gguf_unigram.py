"""llama.cpp tokenizes tunelab's GGUF export of a model with a Unigram tokenizer as transformers.

SentencePiece Unigram models (T5, ALBERT, custom ``tokenizers`` ones) go into the GGUF file as
llama.cpp's ``t5`` vocabulary: the tokens' scores for its Viterbi search, the spaces' rules and
SentencePiece's normalization map. A tiny Unigram tokenizer (``build_unigram_tokenizer``) with a
tiny Mistral model is exported in two layouts: Llama 2's normalizer (a ``▁`` prepended, spaces
replaced) and T5's as transformers converts it (a normalization map, extra spaces merged, a
Metaspace pre-tokenizer).
"""

import pytest

from tests.conftest import build_tiny_hf_model
from tests.gguf_checks import (
    CHARSMAP_RULES,
    SPM_ADDED,
    SPM_SPECIALS,
    TEXTS,
    build_unigram_tokenizer,
    llama,
)
from tunelab.checkpoint.gguf_export import export_gguf
from tunelab.data.tokenizer import load_tokenizer

pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")

LAYOUTS = ("prepend", "t5")
# TEXTS' special tokens are Llama 3's (plain text here); these are this tokenizer's, then text
# the normalization map rewrites and characters no token covers (unknown, runs of them fused).
UNIGRAM_TEXTS = [
    *SPM_SPECIALS, *SPM_ADDED, "a</s>b", "x <s> y", "<start_of_turn>user\nHi<end_of_turn>\n",
    "<end_of_turn><start_of_turn>", " x  y   z", "\u2581 already \u2581\u2581 marked",
    "\ufb01ne \ufb01sh", "no\u00a0break\u00a0\u00a0spaces\u00a0", "\u00a0 lead", "\u0416\u0416 \u05d0",
    "zq\u0416\u0416\u0416zq",
]  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Layout -> (its f16 GGUF, transformers' tokenizer, tunelab's tokenizer), made once."""
    root, result = tmp_path_factory.mktemp("gguf_unigram"), {}
    folders = {layout: root / layout / "epoch_0" for layout in LAYOUTS}
    vocab = max(build_unigram_tokenizer(folders[layout], layout) for layout in LAYOUTS)
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    model = build_tiny_hf_model("mistral", vocab_size=vocab, sliding_window=None, **ids)
    for layout, folder in folders.items():
        model.save_pretrained(folder)
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        result[layout] = (export_gguf(folder, quant="f16"), hf_tokenizer, load_tokenizer(folder))
    return result


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_ids_equal_transformers(exported, layout):
    """llama.cpp gives transformers' (and tunelab's) ids on every string but two kinds, where
    it follows SentencePiece and transformers does not (the file has no key for either): with
    a Prepend normalizer, spaces alone (llama.cpp puts its ▁ before the first character that
    is not a space, so none there); with the Metaspace pre-tokenizer, text starting with a ▁
    (Metaspace adds none before it, llama.cpp does)."""
    path, hf_tokenizer, ours = exported[layout]
    model = llama(path, vocab_only=True)
    assert model.metadata["tokenizer.ggml.model"] == "t5"
    assert model.metadata["tokenizer.ggml.remove_extra_whitespaces"] == str(layout == "t5").lower()
    differ = []
    for text in TEXTS + UNIGRAM_TEXTS:
        ids = model.tokenize(text.encode(), add_bos=True, special=True)
        assert hf_tokenizer(text)["input_ids"] == ours.encode(text), (layout, text)
        if ids != ours.encode(text):
            differ.append(text)
    texts = TEXTS + UNIGRAM_TEXTS
    if layout == "prepend":
        assert differ == [text for text in texts if text and not text.strip(" ")]
    else:
        assert differ == [text for text in texts if text.startswith("\u2581")]


def test_the_normalization_map_is_applied(exported):
    """The control for the T5 layout's map: the texts it rewrites tokenize as their rewriting
    in both llama.cpp and transformers, and otherwise in the layout without a map."""
    texts = ["\ufb01ne \ufb01sh", "no\u00a0break spaces"]
    for layout in LAYOUTS:
        path, hf_tokenizer, _ = exported[layout]
        model = llama(path, vocab_only=True)
        for text in texts:
            rewritten = text
            for key, value in CHARSMAP_RULES.items():
                rewritten = rewritten.replace(key, value)
            same = hf_tokenizer(text)["input_ids"] == hf_tokenizer(rewritten)["input_ids"]
            assert same == (layout == "t5"), (layout, text)
            assert (
                model.tokenize(text.encode(), add_bos=True, special=True)
                == (hf_tokenizer(text)["input_ids"])
            )
