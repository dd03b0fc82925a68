"""llama.cpp (through llama-cpp-python) against tunelab's own model, for the GGUF export tests."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Question: what is 2 + 3?\nAnswer:",
    "<|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|>",
)
NUM_GENERATED = 20
# Strings whose token ids llama.cpp must give as transformers does (llama 3's specials among them).
TEXTS = [
    "Hello world", "hello  world", " leading space", "trailing space ", "", " ", "\n", "\n\n\t x",
    "The year 2024 had 366 days; 12345678 is big.", "don't you'll we've I'M", "e-mail: a@b.cd",
    "naïve café, Zürich", "日本語のテキスト", "emoji 🙂🚀 ok", "tabs\tand\nnewlines\r\n",
    "<|begin_of_text|>", "<|eot_id|>", "a<|eot_id|>b", "<|start_header_id|>user<|end_header_id|>",
    "x <|end_of_text|> y", "<|pad|>", "((nested)) [brackets] {braces}", "snake_case and CamelCase",
    "1+1=2", "3.14159", "$100.00", "50%", "C:\\path\\to\\file", "http://example.com/a?b=c",
    "    indented code", "def f(x):\n    return x", "SHOUTING TEXT", "MiXeD cAsE",
    "repeated repeated repeated", "punctuation!!! ???", "'quoted' \"double\"", "a\u00a0b",
    "Ω≈ç√∫", "---", "...", "word", "ab", "a", "the the the", "The cat sat on the mat.",
    "New\nline", "  two leading", "z" * 40, "12 34 567 8901", "it's 5 o'clock",
]  # fmt: skip


def llama(path: Path, **options):
    """The GGUF file loaded by llama.cpp, every position's logits kept, one thread.

    ``options`` go to ``llama_cpp.Llama`` (e.g. ``type_k=0, type_v=0`` for a float32 KV cache).
    """
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=128,
        logits_all=True,
        verbose=False,
        n_threads=1,
        seed=0,
        **options,
    )


def llama_logits(model, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits ``[len(ids), vocab]`` for ``ids``, from an empty context."""
    model.reset()
    model.eval(ids)
    return np.array(model.scores[: len(ids)], dtype=np.float64)


def llama_greedy(model, ids: list[int], count: int = NUM_GENERATED) -> list[int]:
    """``count`` greedily generated ids, one ``eval`` per token."""
    model.reset()
    model.eval(ids)
    out = []
    for _ in range(count):
        token = int(np.argmax(model.scores[model.n_tokens - 1]))
        out.append(token)
        model.eval([token])
    return out


def tunelab_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """tunelab's fp32 logits ``[len(ids), vocab]``."""
    with torch.no_grad():
        return model(torch.tensor([ids])).double()[0].numpy()


def tunelab_greedy(model: torch.nn.Module, ids: list[int], count: int = NUM_GENERATED) -> list[int]:
    """``count`` greedily generated ids, a full forward per token."""
    ids, out = list(ids), []
    for _ in range(count):
        token = int(tunelab_logits(model, ids)[-1].argmax())
        out.append(token)
        ids.append(token)
    return out


def prompt_ids(tokenizer, text: str) -> list[int]:
    """transformers' ids of a prompt, BOS as the tokenizer config says, special tokens parsed."""
    return tokenizer(text)["input_ids"]


def perplexity(model, sequences: list[list[int]]) -> float:
    """llama.cpp's perplexity over ``sequences`` (each scored from its second token on)."""
    total, count = 0.0, 0
    for ids in sequences:
        logits = llama_logits(model, ids)[:-1]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        total -= log_probs[np.arange(len(ids) - 1), ids[1:]].sum()
        count += len(ids) - 1
    return float(np.exp(total / count))


def with_float16_gelu(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its tanh-GELU computed as ggml's CPU kernel does: input and output rounded
    to float16 (ggml looks the value up in a 65536-entry float16 table)."""
    from tunelab.modules.feed_forward import ACTIVATIONS, FeedForward

    gelu = ACTIVATIONS["gelu_pytorch_tanh"]
    for module in model.modules():
        if isinstance(module, FeedForward) and module.activation is gelu:
            module.activation = lambda x: gelu(x.half().float()).half().float()
    return model


SPM_SPECIALS = ("<unk>", "<s>", "</s>")
SPM_ADDED = ("<start_of_turn>", "<end_of_turn>")
# Phi-3's: added tokens that strip the whitespace after them, but for <|endoftext|>.
PHI3_ADDED = ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>")


# Chat templates in the formats of Llama 2 (system prompt inside the first [INST], BOS before
# every user turn), Gemma (the system prompt folded into the first user turn, "model" turns) and
# Phi-3 (<|role|> turns ended by <|end|>), for build_sentencepiece_tokenizer's layouts.
SPM_CHAT_TEMPLATES = {
    "llama2": (
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}"
        "{%- else -%}{%- set system = none -%}{%- set turns = messages -%}{%- endif -%}"
        "{%- for message in turns -%}{%- set content = message['content'] -%}"
        "{%- if loop.first and system is not none -%}"
        "{%- set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + content -%}{%- endif -%}"
        "{%- if message['role'] == 'user' -%}{{- bos_token + '[INST] ' + content.strip() + ' [/INST]' -}}"
        "{%- else -%}{{- ' ' + content.strip() + ' ' + eos_token -}}{%- endif -%}{%- endfor -%}"
    ),
    "gemma": (
        "{{- bos_token -}}"
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set system = messages[0]['content'] | trim + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
        "{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}"
        "{%- for message in turns -%}"
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
        "{{- '<start_of_turn>' + role + '\\n' + (system if loop.first else '') -}}"
        "{{- message['content'] | trim + '<end_of_turn>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
    ),
    "phi3": (
        "{%- for message in messages -%}"
        "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- else -%}{{- eos_token -}}"
        "{%- endif -%}"
    ),
}


def _training_lines() -> list[str]:
    """The text the tiny SentencePiece-style tokenizers are trained on (tiny SFT rows)."""
    from tunelab._paths import assets_dir

    rows = [json.loads(line) for line in (assets_dir() / "tiny" / "sft.jsonl").open()]
    lines = [" ".join(row.values()) for row in rows[:400]]
    return lines + ["The quick brown fox jumps over the lazy dog. Hello world, don't you'll."] * 5


def _save_spm_tokenizer(tokenizer, folder: Path, chat_template: str | None = None) -> int:
    """Save ``tokenizer`` and a config (``<s>`` added first, ``chat_template`` when given) into
    ``folder``; return its vocabulary size."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab_size()


def build_sentencepiece_tokenizer(
    folder: Path, space_prefix: bool = True, phi3: bool = False, chat_template: str | None = None
) -> int:
    """Write a tiny SentencePiece-style ``tokenizer.json`` and config into ``folder``.

    Laid out as transformers' conversion of a SentencePiece BPE model (Llama 2, Mistral, Gemma):
    ``<unk> <s> </s>``, the 256 byte tokens ``<0xNN>`` (byte fallback), then pieces trained on
    the tiny SFT data; every split of a piece into two pieces is a merge, ranked by the piece's
    id; spaces become ``▁``. ``space_prefix``: Llama 2's ``Prepend("▁")`` normalizer (else
    Gemma's, without). ``<start_of_turn>``/``<end_of_turn>`` are added special tokens, or with
    ``phi3`` Phi-3's (``PHI3_ADDED``), which like ``</s>`` strip the whitespace after them
    (``rstrip``) but for ``<|endoftext|>``. ``chat_template`` goes into
    ``tokenizer_config.json`` (none when None).

    Returns:
        The vocabulary size.
    """
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    space = "\u2581"
    lines = _training_lines()
    trainer = Tokenizer(models.BPE())
    trainer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    trainer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=500, show_progress=False))
    vocab = {token: i for i, token in enumerate(SPM_SPECIALS)}
    vocab.update({f"<0x{byte:02X}>": len(SPM_SPECIALS) + byte for byte in range(256)})
    for token, _ in sorted(trainer.get_vocab().items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    pieces = sorted((i, token) for token, i in vocab.items() if i >= len(SPM_SPECIALS) + 256)
    merges = [
        (token[:k], token[k:])
        for _, token in pieces
        for k in range(1, len(token))
        if token[:k] in vocab and token[k:] in vocab
    ]
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    prepend = [normalizers.Prepend(space)] if space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*prepend, normalizers.Replace(" ", space)])
    strip = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    added = SPM_SPECIALS + (PHI3_ADDED if phi3 else SPM_ADDED)
    strips = {"</s>", *PHI3_ADDED[1:]} if phi3 else set()
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False, special=True, rstrip=t in strips) for t in added]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return _save_spm_tokenizer(tokenizer, folder, chat_template)


# SentencePiece's normalization map for build_unigram_tokenizer's T5 layout: a few of the rules
# of its nmt_nfkc map (a no-break space, tab, newline and carriage return are spaces, the "ﬁ"
# ligature is "fi"), enough to show that llama.cpp and tokenizers read the same bytes alike.
CHARSMAP_RULES = {"\u00a0": " ", "\t": " ", "\n": " ", "\r": " ", "\ufb01": "fi"}


def precompiled_charsmap(rules: dict[str, str]) -> bytes:
    """SentencePiece's ``precompiled_charsmap`` bytes for ``rules`` (text -> replacement).

    The layout both readers take (llama.cpp's ``t5`` tokenizer, tokenizers' ``Precompiled``):
    the trie's size in bytes (uint32), the trie as a Darts-clone double array of uint32 units,
    then the replacements, each ended by a NUL. A node at position ``p`` whose unit holds
    offset ``o`` has its children at ``(p ^ o) ^ byte`` and, where a key ends there, the unit
    of the key's replacement (bit 31 set, its byte offset) at ``p ^ o``. Every position stays
    below 256 and the array is 256 units long, so no lookup reads past it.
    """
    trie: dict = {}
    for key in rules:
        node = trie
        for byte in key.encode():
            node = node.setdefault(byte, {})
        node[None] = key
    replacements, starts = b"", {}
    for key, value in rules.items():
        starts[key] = len(replacements)
        replacements += value.encode() + b"\0"
    units, used = [0] * 256, {0}

    def positions(node: dict, base: int) -> set[int]:
        """Where ``node``'s children (and its key's replacement unit) go for ``base``."""
        return {base ^ label if label is not None else base for label in node}

    def place(node: dict) -> int:
        """Fill the units below ``node``; return its base."""
        base = next(b for b in range(1, 256) if not used & positions(node, b))
        used.update(positions(node, base))
        for label, child in node.items():
            if label is None:
                units[base] = (1 << 31) | starts[child]
                continue
            leaf = (1 << 8) if None in child else 0
            position = base ^ label
            units[position] = ((position ^ place(child)) << 10) | leaf | label
        return base

    units[0] = place(trie) << 10  # the root's offset: its base (0 ^ base)
    array = b"".join(unit.to_bytes(4, "little") for unit in units)
    return len(array).to_bytes(4, "little") + array + replacements


def build_unigram_tokenizer(folder: Path, layout: str) -> int:
    """Write a tiny SentencePiece-style Unigram ``tokenizer.json`` and config into ``folder``.

    ``<unk> <s> </s>`` then pieces trained by ``tokenizers``' Unigram trainer on the tiny SFT
    data (spaces as ``▁``), ``<start_of_turn>``/``<end_of_turn>`` added special tokens.
    ``layout``: ``"prepend"`` (Llama 2's normalizer: ``Prepend("▁")``, ``Replace(" ", "▁")``,
    no pre-tokenizer) or ``"t5"`` (as transformers converts T5's SentencePiece model: a
    normalization map, ``Strip`` on the right, runs of spaces made one ``▁``, a Metaspace
    pre-tokenizer that splits words).

    Returns:
        The vocabulary size.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    space = "\u2581"
    lines = _training_lines()
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=500, special_tokens=list(SPM_SPECIALS), unk_token="<unk>", show_progress=False
    )
    tokenizer.train_from_iterator(lines, trainer)
    if layout == "prepend":
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(space), normalizers.Replace(" ", space)]
        )
        tokenizer.pre_tokenizer = None
    else:
        tokenizer.normalizer = normalizers.Sequence([
            normalizers.Precompiled(precompiled_charsmap(CHARSMAP_RULES)),
            normalizers.Strip(left=False, right=True),
            normalizers.Replace(Regex(" {2,}"), space),
        ])  # fmt: skip
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in SPM_SPECIALS + SPM_ADDED]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return _save_spm_tokenizer(tokenizer, folder)
