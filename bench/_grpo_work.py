"""bench_grpo's shapes, prompts and the equal-work check (no trainer imported here).

Both sides sample at temperature 1 with the stop tokens unreachable (tunelab: no stop ids;
TRL: ``min_new_tokens`` equal to the maximum, so ``generate`` masks EOS at every position), so
every completion is ``max_new_tokens`` long on both sides while the tokens themselves differ
(two samplers never draw the same tokens from one seed). The same work is then the same count
of completions, of prompt tokens and of completion tokens in every step: :func:`work_difference`
compares them before any ratio is printed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

TINY = Path(__file__).resolve().parents[1] / "framework" / "tunelab" / "assets" / "tiny"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAD_ID, EOS_ID = 0, 1  # of the word tokenizer: prompts never hold them

Work = list[list[tuple[int, int]]]
"""What one side did: per step, the sorted ``(prompt tokens, completion tokens)`` of each row."""


@dataclass(frozen=True)
class Shape:
    """One model and prompt length of the bench."""

    name: str
    model: str
    """``tiny`` (the embedded model) or ``wide`` (the synthetic Llama-style one)."""
    prompt_tokens: int


def ended(ids: Sequence[int], stop_ids: Collection[int]) -> tuple[int, ...]:
    """``ids`` up to and including the first stop token: the completion a trainer keeps."""
    ids = [int(i) for i in ids]
    for position, token in enumerate(ids):
        if token in stop_ids:
            return tuple(ids[: position + 1])
    return tuple(ids)


def work_difference(ours: Work, theirs: Work) -> str | None:
    """How the work two sides did differs, in words; None when it is the same.

    The same work: as many steps, and in each as many completions, with the same prompt and
    completion lengths (hence the same token counts).

    Args:
        ours: tunelab's work, per step.
        theirs: The other side's, per step.

    Returns:
        The first difference found, or None.
    """
    if len(ours) != len(theirs):
        return f"tunelab ran {len(ours)} steps, TRL {len(theirs)}"
    for step, (our_rows, their_rows) in enumerate(zip(ours, theirs)):
        if len(our_rows) != len(their_rows):
            return f"step {step}: {len(our_rows)} completions against {len(their_rows)}"
        for index, name in ((0, "prompt"), (1, "completion")):
            our_tokens = sum(row[index] for row in our_rows)
            their_tokens = sum(row[index] for row in their_rows)
            if our_tokens != their_tokens:
                return f"step {step}: {our_tokens} {name} tokens against {their_tokens}"
        if sorted(map(tuple, our_rows)) != sorted(map(tuple, their_rows)):
            return f"step {step}: the same totals, other (prompt, completion) lengths"
    return None


def wide_config(dim: int, num_layers: int, vocab_size: int) -> dict:
    """The realistic shape: Llama-style, GQA 12/4 at 768, MLP 2048 at 768 (scaled with dim)."""
    from _models import llama_config

    config = llama_config(
        dim=dim, num_layers=num_layers, vocab_size=vocab_size, intermediate_dim=dim * 8 // 3
    )
    config["num_key_value_heads"] = max(1, config["num_attention_heads"] // 3)
    return config


def word_tokenizer(vocab_size: int):
    """A tokenizer with one word per id (``w2`` ... ``w{V-1}``): a prompt of n words is n ids.

    Padding and EOS are ``<pad>`` (0) and ``</s>`` (1): an added special token is matched
    inside words, so ``w1`` as EOS would split ``w17`` into two tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "</s>": EOS_ID} | {f"w{i}": i for i in range(2, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")


def prepare(root: Path, args, shapes: Sequence[Shape]) -> dict[str, Path]:
    """Write each model folder (config, weights, word tokenizer) and each shape's prompts.

    Returns:
        Shape name -> its prompts file (JSON: the model folder and the prompt token ids).
    """
    from _models import write_hf_checkpoint

    folders = {}
    for model in {shape.model for shape in shapes}:
        folder = folders[model] = root / model
        if (folder / "tokenizer.json").exists():  # written by an earlier run (--reuse)
            continue
        if model == "tiny":
            folder.mkdir(parents=True)
            for name in ("config.json", "model.safetensors"):
                shutil.copy(TINY / name, folder / name)
        else:
            write_hf_checkpoint(folder, wide_config(args.dim, args.layers, args.vocab_size))
        vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
        word_tokenizer(vocab_size).save_pretrained(folder)
    paths = {}
    for shape in shapes:
        folder = folders[shape.model]
        vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
        generator = torch.Generator().manual_seed(shape.prompt_tokens)
        rows = (1 + args.steps) * args.prompts
        prompts = torch.randint(2, vocab_size, (rows, shape.prompt_tokens), generator=generator)
        path = root / f"{shape.name}.json"
        path.write_text(json.dumps({"model": str(folder), "prompts": prompts.tolist()}))
        paths[shape.name] = path
    return paths


def parity_reward(completions: Sequence[str]) -> list[float]:
    """Both sides' reward: the share of words with an even id (varies, so advantages do too)."""
    rewards = []
    for text in completions:
        words = text.split()
        rewards.append(
            sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / len(words or [0])
        )
    return rewards
