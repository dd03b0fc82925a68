"""The tokenizer a GGUF file carries: vocabulary, merges or scores, types, special ids, template.

llama.cpp tokenizes with its own implementation, so the file must say everything
``tokenizer.json`` does. Two kinds of ``tokenizer.json`` BPE models are written:

- Byte-level BPE (Llama 3, Qwen, GPT-2): ``tokenizer.ggml.model = gpt2`` with the merges and the
  name of the pre-tokenizer. llama.cpp implements each pre-tokenizer regex in C++ under a name
  (``llama-bpe``, ``qwen2``, ``gpt-2``); the name is chosen by the regex ``tokenizer.json``
  holds, and a regex llama.cpp does not know is refused rather than guessed.
- SentencePiece-style BPE (Llama 2, Mistral, Gemma, Phi-3: byte fallback, spaces as ``▁``):
  llama.cpp's ``llama`` vocabulary, which merges the adjacent pair whose joined text is the
  highest-scored token. A token made by the merge of rank ``r`` is scored ``-r`` (the first
  merge that makes it), every other token 0, so llama.cpp merges in the order of
  ``tokenizer.json``'s merges; the ``<0xNN>`` tokens are byte tokens (llama.cpp's fallback for
  text no token covers), the unknown token is typed so. Whether a ``▁`` is put before the text
  (``add_space_prefix``) follows the normalizer's ``Prepend`` or the Metaspace pre-tokenizer's
  ``prepend_scheme``; a normalizer or pre-tokenizer llama.cpp does not reproduce is refused.
- SentencePiece-style Unigram (T5, ALBERT, custom ``tokenizers`` models): llama.cpp's ``t5``
  vocabulary, which runs the same Viterbi search over the tokens' log-probability scores (an
  unknown character scored 10 below the lowest, runs of unknowns fused, as ``tokenizers``
  does). The spaces follow the same steps as above, plus T5's merging of extra spaces
  (``remove_extra_whitespaces``) and SentencePiece's own normalization map (``Precompiled``),
  which llama.cpp applies from the same bytes. A Unigram model with byte fallback is refused
  (llama.cpp's ``t5`` vocabulary writes unknown characters as the unknown token).

Each token's type: added special tokens are control tokens, other added tokens user-defined,
as llama.cpp's converter marks them. The special ids and whether BOS is added come from
tunelab's ``Tokenizer`` (as it reads them from the config files), then the chat template.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from tunelab._model_files import read_model_text
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import CheckpointError

__all__ = ["model_name", "write_vocab"]

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


_SPACE = "\u2581"  # SentencePiece's visible space
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _steps(spec: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A normalizer or pre-tokenizer as its list of steps (a Sequence flattened)."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [step for inner in spec[key] for step in _steps(inner, key)]
    return [spec]


@dataclass(frozen=True)
class _Spaces:
    """How a SentencePiece-style tokenizer writes spaces, in llama.cpp's keys."""

    prefix: bool
    """A ``▁`` goes before the text (``add_space_prefix``)."""
    merge: bool = False
    """Leading and trailing spaces dropped, runs of them made one (``remove_extra_whitespaces``)."""
    charsmap: bytes | None = None
    """SentencePiece's normalization map (``precompiled_charsmap``), applied first."""


def _is_merge_of_spaces(steps: list[dict[str, Any]], index: int) -> bool:
    """Whether ``steps[index:index + 2]`` are T5's ``Strip(right)`` and ``Replace(" {2,}", "▁")``."""
    strip = steps[index]
    replace = steps[index + 1] if index + 1 < len(steps) else {}
    return (
        strip.get("type") == "Strip"
        and not strip.get("strip_left")
        and strip.get("strip_right")
        and replace.get("type") == "Replace"
        and replace.get("pattern") == {"Regex": " {2,}"}
        and replace.get("content") == _SPACE
    )


def _spaces(data: dict[str, Any], tokens: dict[int, str], source: Path, unigram: bool) -> _Spaces:
    """How a SentencePiece-style tokenizer writes spaces, checked to be llama.cpp's way.

    ``unigram``: llama.cpp's ``t5`` vocabulary, which also merges spaces and applies a
    normalization map (the ``llama`` vocabulary does neither).
    """
    prefix, spaces, merge, charsmap = False, False, False, None
    steps = _steps(data.get("normalizer"), "normalizers")
    index = 0
    while index < len(steps):
        step = steps[index]
        if step.get("type") == "Prepend" and step.get("prepend") == _SPACE:
            prefix = True
        elif (
            step.get("type") == "Replace"
            and step.get("pattern") == {"String": " "}
            and step.get("content") == _SPACE
        ):
            spaces = True
        elif unigram and step.get("type") == "Precompiled" and index == 0:
            charsmap = base64.b64decode(step["precompiled_charsmap"]) or None
        elif unigram and _is_merge_of_spaces(steps, index):
            if charsmap is None:
                # Strip drops every whitespace character at the end, llama.cpp only spaces:
                # the same where SentencePiece's map makes the others spaces first.
                raise CheckpointError(
                    f"{source}: GGUF export: this tokenizer strips all whitespace at the end of "
                    "the text and llama.cpp only spaces; they agree only after a Precompiled "
                    "normalization map that makes tabs and newlines spaces, and there is none"
                )
            merge = spaces = True
            index += 1
        else:
            extra = ", Precompiled first, T5's Strip + Replace of ' {2,}'" if unigram else ""
            raise CheckpointError(
                f"{source}: GGUF export: llama.cpp's SentencePiece tokenizer has no equivalent "
                f"of the normalizer step {step.get('type')} (supported: Prepend and Replace of "
                f"spaces with \u2581{extra})"
            )
        index += 1
    for step in _steps(data.get("pre_tokenizer"), "pretokenizers"):
        if step.get("type") != "Metaspace" or step.get("replacement", _SPACE) != _SPACE:
            raise CheckpointError(
                f"{source}: GGUF export: llama.cpp's SentencePiece tokenizer has no equivalent "
                f"of the pre-tokenizer {step.get('type')} (supported: Metaspace, none)"
            )
        spaces = True
        prefix = prefix or step.get("prepend_scheme", "always") != "never"
        # Splitting at each ▁ changes nothing unless a token holds a ▁ past its start.
        if step.get("split", True) and any(_SPACE in token[1:] for token in tokens.values()):
            raise CheckpointError(
                f"{source}: GGUF export: the Metaspace pre-tokenizer splits words, and "
                "llama.cpp's SentencePiece tokenizer does not (tokens span a \u2581)"
            )
    if not spaces:
        raise CheckpointError(
            f"{source}: GGUF export: this SentencePiece-style tokenizer keeps spaces as they "
            "are; llama.cpp's SentencePiece tokenizer writes them as \u2581"
        )
    if merge and not prefix:
        # llama.cpp puts a ▁ before every word when it merges spaces, the first one included.
        raise CheckpointError(
            f"{source}: GGUF export: this tokenizer merges spaces without putting \u2581 before "
            "the text; llama.cpp's does both or neither"
        )
    return _Spaces(prefix, merge, charsmap)


def _spm_scores(model: dict[str, Any], tokens: dict[int, str]) -> dict[int, float]:
    """``-rank`` of the first merge that makes each token; 0 for the others."""
    ids = {token: i for i, token in tokens.items()}
    scores = dict.fromkeys(tokens, 0.0)
    made: set[int] = set()
    for rank, merge in enumerate(_merges(model)):
        token_id = ids.get(merge.replace(" ", "", 1))
        if token_id is not None and token_id not in made:
            made.add(token_id)
            scores[token_id] = -float(rank)
    return scores


# llama.cpp reads general.name: one containing "phi3" or "phi-3" (any case) makes its loader
# strip the whitespace after every special token but these three (as Phi-3's tokenizer.json
# flags them: rstrip), looking each of them and </s> up by text; a vocabulary without one of
# them fails to load ("unordered_map::at").
_PHI3_NAME = re.compile(r"(?i)(phi)-?3")
_PHI3_KEEPS_SPACE = ("<unk>", "<s>", "<|endoftext|>")
_PHI3_LOOKUPS = ("</s>", *_PHI3_KEEPS_SPACE)


def model_name(name: str, added_tokens: list[dict[str, Any]]) -> str:
    """The ``general.name`` to write for a model called ``name``.

    Args:
        name: The model's name (the export folder's).
        added_tokens: ``tokenizer.json``'s added tokens.

    Returns:
        ``name``, with ``phi3-`` put before it when its added tokens strip the whitespace after
        them exactly as llama.cpp does for a Phi-3 name (so llama.cpp tokenizes as
        transformers does), or with ``phi3``/``phi-3`` written ``phi_3`` when llama.cpp would
        take it for a Phi-3 name but the tokens it then looks up are not all there.
    """
    flags = {token["content"]: bool(token.get("rstrip")) for token in added_tokens}
    phi3_rule = all(token in flags for token in _PHI3_LOOKUPS) and all(
        strip == (token not in _PHI3_KEEPS_SPACE) for token, strip in flags.items()
    )
    if phi3_rule:
        return name if _PHI3_NAME.search(name) else f"phi3-{name}"
    if _PHI3_NAME.search(name) and not all(token in flags for token in _PHI3_LOOKUPS):
        return _PHI3_NAME.sub(r"\1_3", name)
    return name


def _write_unigram(
    writer: gguf.GGUFWriter,
    data: dict[str, Any],
    tokens: dict[int, str],
    types: dict[int, gguf.TokenType],
    source: Path,
    vocab_size: int,
) -> None:
    """The ``t5`` vocabulary keys of a Unigram ``tokenizer.json`` but its tokens and types."""
    model = data["model"]
    if model.get("byte_fallback"):
        raise CheckpointError(
            f"{source}: GGUF export: this Unigram tokenizer falls back to byte tokens; "
            "llama.cpp's Unigram tokenizer (t5) has no byte fallback"
        )
    unk_id = model.get("unk_id")
    if unk_id is None:
        raise CheckpointError(
            f"{source}: GGUF export: this Unigram tokenizer has no unk_id; llama.cpp's (t5) "
            "writes unknown characters as the unknown token"
        )
    scores = [float(entry[1]) for entry in model["vocab"]]
    # Both score an unknown character 10 below the lowest score: tokenizers' over every
    # vocabulary entry, llama.cpp's over its normal tokens only.
    normal = [score for i, score in enumerate(scores) if types[i] == gguf.TokenType.NORMAL]
    lowest = min(normal, default=min(scores))
    if min(scores) < lowest:
        raise CheckpointError(
            f"{source}: GGUF export: a special token of this Unigram tokenizer has the lowest "
            "score, which llama.cpp's (t5) leaves out when it scores unknown characters"
        )
    spaces = _spaces(data, tokens, source, unigram=True)
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_add_space_prefix(spaces.prefix)
    writer.add_remove_extra_whitespaces(spaces.merge)
    if spaces.charsmap is not None:
        writer.add_precompiled_charsmap(spaces.charsmap)
    writer.add_token_scores([scores[i] if i < len(scores) else -1000.0 for i in range(vocab_size)])
    writer.add_unk_token_id(unk_id)


def write_vocab(
    writer: gguf.GGUFWriter, folder: Path, tokenizer: Tokenizer, vocab_size: int
) -> list[dict[str, Any]]:
    """Add the tokenizer of the model folder ``folder`` to ``writer``.

    Args:
        writer: The GGUF writer (before its header is written).
        folder: The model folder holding ``tokenizer.json``.
        tokenizer: tunelab's tokenizer of that folder (special ids, BOS rule, chat template).
        vocab_size: The model's vocabulary size (ids past the tokenizer's are unused).

    Returns:
        ``tokenizer.json``'s added tokens (for :func:`model_name`).

    Raises:
        CheckpointError: If the tokenizer is neither byte-level nor SentencePiece-style BPE
            nor Unigram, llama.cpp would split or normalize its text differently, or it has
            more tokens than the model.
    """
    source = folder / "tokenizer.json"
    data = json.loads(read_model_text(source, folder))
    model = data.get("model", {})
    kind = model.get("type")
    if kind not in ("BPE", "Unigram"):
        raise CheckpointError(
            f"{source}: GGUF export supports BPE (byte-level or SentencePiece-style) and Unigram "
            f"tokenizers; this one is {kind}"
        )
    sentencepiece = bool(model.get("byte_fallback"))
    if kind == "Unigram":
        tokens: dict[int, str] = {i: entry[0] for i, entry in enumerate(model["vocab"])}
    else:
        tokens = {int(i): t for t, i in model["vocab"].items()}
    types = dict.fromkeys(tokens, gguf.TokenType.NORMAL)
    if sentencepiece:
        for i, token in tokens.items():
            if _BYTE_TOKEN.fullmatch(token):
                types[i] = gguf.TokenType.BYTE
        if model.get("unk_token") in model["vocab"]:
            types[model["vocab"][model["unk_token"]]] = gguf.TokenType.UNKNOWN
    if kind == "Unigram" and model.get("unk_id") is not None:
        types[model["unk_id"]] = gguf.TokenType.UNKNOWN
    for added in data.get("added_tokens", []):
        if types.get(added["id"]) in (gguf.TokenType.BYTE, gguf.TokenType.UNKNOWN):
            continue
        tokens[added["id"]] = added["content"]
        special = added.get("special") or _looks_special(added["content"])
        types[added["id"]] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    if max(tokens) >= vocab_size:
        raise CheckpointError(
            f"{source}: token id {max(tokens)} does not fit the model's vocab_size {vocab_size}"
        )
    if kind == "Unigram":
        _write_unigram(writer, data, tokens, types, source, vocab_size)
    elif sentencepiece:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_add_space_prefix(_spaces(data, tokens, source, unigram=False).prefix)
        scores = _spm_scores(model, tokens)
        writer.add_token_scores([scores.get(i, -1000.0) for i in range(vocab_size)])
        if types.get(model["vocab"].get(model.get("unk_token"), -1)) == gguf.TokenType.UNKNOWN:
            writer.add_unk_token_id(model["vocab"][model["unk_token"]])
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_pre_tokenizer(data.get("pre_tokenizer"), source))
        writer.add_token_merges(_merges(model))
    writer.add_token_list([tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)])
    writer.add_token_types([types.get(i, gguf.TokenType.UNUSED) for i in range(vocab_size)])
    if tokenizer.bos_id is not None:
        writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_pad_token_id(tokenizer.pad_id)
    writer.add_add_bos_token(tokenizer.add_bos_token)
    writer.add_add_eos_token(False)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template.text)
    return data.get("added_tokens", [])
