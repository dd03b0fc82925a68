"""The log-prob forward of a rollout micro-batch with each distinct prompt computed once.

A row of a :func:`~tunelab.rl.rollout_batch` is its prompt, then its completion (the labelled
span, which may hold unlabelled tokens such as tool output), then padding. Rows whose prompts
are equal (a GRPO group) share one forward of the prompt: the model runs one packed row of the
distinct prompts and the rows' continuations (:class:`~tunelab.modules.SharedPrefix`), and the
result is gathered back into the batch's ``[rows, seq, ...]`` layout, so the chunked output
layer and the losses see exactly what the per-row forward gives them. Gradients flow through
the gather and the prompt keys' ``index_select`` to the one prompt computation; they equal the
per-row ones up to summation order (tests/unit/test_grpo_shared_prompts.py: 1e-6 in fp32).

Models it does not apply to take the per-row forward (said once in the log): sliding-window
layers, mixture-of-experts blocks and LongRoPE scaling (their forward depends on more than each
token and the keys it sees), and packed or context-parallel batches.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tunelab.models.args import SLIDING
from tunelab.modules import SharedPrefix
from tunelab.rl.decoding import distinct_prompts

__all__ = ["shared_prompt_forward"]

logger = logging.getLogger(__name__)
_said: set[str] = set()


def _unsupported(model: nn.Module) -> str | None:
    """Why ``model``'s forward cannot share prompts, or None."""
    args = getattr(model, "args", None)
    if args is None or not hasattr(model, "rope_recompute_position"):
        return "not a TransformerDecoder"
    if SLIDING in (args.layer_types or ()):
        return "sliding-window layers"
    if args.num_experts:
        return "mixture-of-experts blocks"
    if model.rope_recompute_position() is not None:
        return "LongRoPE scaling"
    return None


def shared_prompt_forward(
    model: nn.Module, batch: dict[str, torch.Tensor], *, return_hidden: bool
) -> torch.Tensor | None:
    """The model's output for ``batch``, each distinct prompt computed once; None: per row.

    Args:
        model: The decoder (plain or FSDP2-sharded).
        batch: A rollout batch: ``tokens`` and ``labels`` ``[rows, seq]`` (-100 off the
            completions).
        return_hidden: Final hidden states (for the chunked output layer) instead of logits.

    Returns:
        ``[rows, seq, dim]`` hidden states (or ``[rows, seq, vocab]`` logits) equal to
        ``model(batch["tokens"])``'s at every position up to each row's last label, or None
        when no two rows share a prompt or the model or batch does not allow it.
    """
    reason = _unsupported(model)
    if reason is None and ("document_ids" in batch or "input_pos" in batch):
        reason = "packed batches"
    if reason is not None:
        if reason not in _said:
            _said.add(reason)
            logger.info("log-probs: per-row forward (no shared prompts) for %s", reason)
        return None
    tokens, labels = batch["tokens"], batch["labels"]
    rows, width = tokens.shape
    scored = labels != -100
    if not bool(scored.any(dim=1).all()):
        return None
    device = tokens.device
    slots = torch.arange(width, device=device)
    prompt_lengths = scored.int().argmax(dim=1)  # the first labelled position
    ends = torch.where(scored, slots, -1).amax(dim=1) + 1  # after the last one
    lengths = prompt_lengths.tolist()
    unique, of_row = distinct_prompts(
        [row[:length] for row, length in zip(tokens.tolist(), lengths, strict=True)]
    )
    if len(unique) == rows:
        return None
    prompt_len = max(lengths)
    completion_len = int((ends - prompt_lengths).max())
    prompts = torch.zeros(len(unique), prompt_len, dtype=torch.long)
    for index, prompt in enumerate(unique):
        prompts[index, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    steps = torch.arange(completion_len, device=device)
    completion_pos = prompt_lengths[:, None] + steps  # [rows, completion_len]
    completions = tokens.gather(1, completion_pos.clamp(max=width - 1))
    packed = torch.cat([prompts.to(device).reshape(-1), completions.reshape(-1)])[None]
    positions = torch.cat(
        [torch.arange(prompt_len, device=device).repeat(len(unique)), completion_pos.reshape(-1)]
    )[None]
    of_row_index = torch.tensor(of_row, device=device)
    layout = SharedPrefix(len(unique), prompt_len, of_row_index, prompt_lengths, completion_len)
    out = model(packed, input_pos=positions, shared_prefix=layout, return_hidden=return_hidden)
    # Each batch position's slot in the packed row: its prompt's, or its own continuation's.
    in_prompt = of_row_index[:, None] * prompt_len + slots
    offset = (slots - prompt_lengths[:, None]).clamp(0, completion_len - 1)
    in_completion = (
        len(unique) * prompt_len
        + torch.arange(rows, device=device)[:, None] * completion_len
        + offset
    )
    index = torch.where(slots < prompt_lengths[:, None], in_prompt, in_completion)
    return out[0][index]
