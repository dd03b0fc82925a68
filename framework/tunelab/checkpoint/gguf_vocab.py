"""The tokenizer a GGUF file carries: vocabulary, merges, token types, special ids, template.

llama.cpp tokenizes with its own implementation, so the file must say everything
``tokenizer.json`` does: the byte-level BPE vocabulary (``tokenizer.ggml.model = gpt2``) with
its merges, each token's type (added special tokens are control tokens, other added tokens
user-defined, as llama.cpp's converter marks them), the special ids and whether BOS is added
(as tunelab's ``Tokenizer`` reads them from the config files), the chat template, and the
name of the pre-tokenizer. llama.cpp implements each pre-tokenizer regex in C++ under a name
(``llama-bpe``, ``qwen2``, ``gpt-2``); the name is chosen by the regex ``tokenizer.json``
holds, and a regex llama.cpp does not know is refused rather than guessed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf

from tunelab._model_files import read_model_text
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import CheckpointError

__all__ = ["write_vocab"]

# llama.cpp's pre-tokenizer names by the split regex of tokenizer.json.
_PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}


def _pre_tokenizer(spec: dict[str, Any] | None, source: Path) -> str:
    """llama.cpp's name for ``tokenizer.json``'s pre-tokenizer."""
    steps = (spec or {}).get("pretokenizers", [spec] if spec else [])
    regexes = [
        step["pattern"]["Regex"]
        for step in steps
        if step.get("type") == "Split" and "Regex" in step.get("pattern", {})
    ]
    byte_level = [step for step in steps if step.get("type") == "ByteLevel"]
    if len(regexes) == 1 and regexes[0] in _PRE_TOKENIZERS:
        return _PRE_TOKENIZERS[regexes[0]]
    if not regexes and len(byte_level) == 1 and byte_level[0].get("use_regex", True):
        return "gpt-2"
    raise CheckpointError(
        f"{source}: GGUF export knows no llama.cpp pre-tokenizer for this tokenizer.json "
        f"pre_tokenizer (split regexes {regexes}); supported: llama-bpe, qwen2, gpt-2"
    )


def _merges(model: dict[str, Any]) -> list[str]:
    # tokenizers writes merges as "a b" strings (older) or [a, b] pairs (newer).
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def _looks_special(token: str) -> bool:
    # Added tokens some tokenizers leave unmarked but llama.cpp's converter treats as control.
    return (token.startswith("<|") and token.endswith("|>")) or token in ("<pad>", "<mask>")


def write_vocab(
    writer: gguf.GGUFWriter, folder: Path, tokenizer: Tokenizer, vocab_size: int
) -> None:
    """Add the tokenizer of the model folder ``folder`` to ``writer``.

    Args:
        writer: The GGUF writer (before its header is written).
        folder: The model folder holding ``tokenizer.json``.
        tokenizer: tunelab's tokenizer of that folder (special ids, BOS rule, chat template).
        vocab_size: The model's vocabulary size (ids past the tokenizer's are unused).

    Raises:
        CheckpointError: If the tokenizer is not byte-level BPE, its pre-tokenizer has no
            llama.cpp name, or it has more tokens than the model.
    """
    source = folder / "tokenizer.json"
    data = json.loads(read_model_text(source, folder))
    model = data.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise CheckpointError(
            f"{source}: GGUF export supports byte-level BPE tokenizers only (this one is "
            f"{model.get('type')}{' with byte fallback' if model.get('byte_fallback') else ''})"
        )
    tokens: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    types = dict.fromkeys(tokens, gguf.TokenType.NORMAL)
    for added in data.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        special = added.get("special") or _looks_special(added["content"])
        types[added["id"]] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    if max(tokens) >= vocab_size:
        raise CheckpointError(
            f"{source}: token id {max(tokens)} does not fit the model's vocab_size {vocab_size}"
        )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(data.get("pre_tokenizer"), source))
    writer.add_token_list([tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)])
    writer.add_token_types([types.get(i, gguf.TokenType.UNUSED) for i in range(vocab_size)])
    writer.add_token_merges(_merges(model))
    if tokenizer.bos_id is not None:
        writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_pad_token_id(tokenizer.pad_id)
    writer.add_add_bos_token(tokenizer.add_bos_token)
    writer.add_add_eos_token(False)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template.text)
