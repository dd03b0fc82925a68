"""The forward of a micro-batch whose rows share prompts, each distinct prompt computed once.

A row is its prompt (the unlabelled prefix), then its completion (the labelled span, which may
hold unlabelled tokens such as tool output), then padding. Rows whose prompts are equal share
one forward of the prompt: a GRPO group (``G`` completions of a prompt), a preference pair (the
chosen and rejected answers: DPO, ORPO, SimPO, the reward model) and a KTO row with its
mismatched pair in the reference pass. The model runs one packed row of the distinct prompts
and the rows' continuations (:class:`~tunelab.modules.SharedPrefix`), and the result is
gathered back into the batch's ``[rows, seq, ...]`` layout, so the chunked output layer, the
losses and the reward head see exactly what the per-row forward gives them. Gradients flow
through the gather and the prompt keys' ``index_select`` to the one prompt computation; they
equal the per-row ones up to summation order (tests/unit/test_grpo_shared_prompts.py and
tests/unit/test_shared_prompt_pairs.py: 1e-6 in fp32).

Models it does not apply to take the per-row forward (said once in the log): sliding-window
layers, mixture-of-experts blocks and LongRoPE scaling (their forward depends on more than each
token and the keys it sees), tensor-parallel models, and packed, context-parallel or image
batches.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from tunelab.losses import OutputLayer
from tunelab.models.args import SLIDING
from tunelab.modules import SharedPrefix
from tunelab.training.loop import forward, scored_rows_only

__all__ = ["distinct_prompts", "forward_sharing_prompts", "shared_prompt_forward"]

logger = logging.getLogger(__name__)
_said: set[str] = set()


def distinct_prompts(
    prompts: list[list[int]], images: Sequence[object | None] | None = None
) -> tuple[list[list[int]], list[int]]:
    """Each distinct prompt once (first-seen order), and each row's index among them.

    Equal prompts are found by their tokens, wherever they sit in the batch.

    Args:
        prompts: Prompt token ids, one list per row.
        images: Each row's images (a vision-language prompt), or None: rows are equal only
            when their tokens are and they hold the same images object (equal token ids may
            stand for other images of the same size).

    Returns:
        ``(unique, of_row)``: ``prompts[row] == unique[of_row[row]]`` for every row.
    """
    if images is None:
        first: dict[tuple[int, ...], int] = {}
        of_row = [first.setdefault(tuple(prompt), len(first)) for prompt in prompts]
        return [list(key) for key in first], of_row
    seen: dict[tuple[object, ...], int] = {}
    unique, of_row = [], []
    for prompt, image in zip(prompts, images, strict=True):
        index = seen.setdefault((id(image), *prompt), len(seen))
        if index == len(unique):
            unique.append(list(prompt))
        of_row.append(index)
    return unique, of_row


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
    # The attribute parallelize_decoder sets (a tensor-parallel reward model has no lm_head).
    if getattr(model, "tensor_parallel_mesh", None) is not None:
        return "tensor parallelism"
    return None


def shared_prompt_forward(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    return_hidden: bool,
    positions: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The model's output for ``batch``, each distinct prompt computed once; None: per row.

    Args:
        model: The decoder (plain or FSDP2-sharded).
        batch: ``tokens`` and ``labels`` ``[rows, seq]`` (-100 off the completions): a
            rollout, preference or KTO batch.
        return_hidden: Final hidden states (for the chunked output layer) instead of logits.
        positions: Positions of ``[rows * seq]`` whose output is wanted (in each row's span),
            e.g. ``tunelab.losses.scored_rows``: the last layer computes past attention at
            their packed positions only (``TransformerDecoder.forward(rows=...)``).

    Returns:
        ``[rows, seq, dim]`` hidden states (or ``[rows, seq, vocab]`` logits) equal to
        ``model(batch["tokens"])``'s at every position up to each row's last label (with
        ``positions``: ``[len(positions), ...]``, theirs), or None when no two rows share a
        prompt or the model or batch does not allow it.
    """
    reason = _unsupported(model)
    if reason is None and ("document_ids" in batch or "input_pos" in batch):
        reason = "packed batches"
    if reason is None and ("pixel_values" in batch or "pixel_values_videos" in batch):
        reason = "image batches"
    if reason is not None:
        if reason not in _said:
            _said.add(reason)
            logger.info("per-row forward (no shared prompts) for %s", reason)
        return None
    tokens, labels = batch["tokens"], batch["labels"]
    rows, width = tokens.shape
    scored = labels != -100
    if not bool(scored.any(dim=1).all()):
        return None
    device = tokens.device
    columns = torch.arange(width, device=device)
    prompt_lengths = scored.int().argmax(dim=1)  # the first labelled position
    ends = torch.where(scored, columns, -1).amax(dim=1) + 1  # after the last one
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
    grid_tokens = torch.cat([prompts.to(device).reshape(-1), completions.reshape(-1)])
    grid_positions = torch.cat(
        [torch.arange(prompt_len, device=device).repeat(len(unique)), completion_pos.reshape(-1)]
    )
    # The grid's occupied slots: each distinct prompt's tokens, each row's span; the forward
    # runs these only (no projection or MLP on padding).
    unique_lengths = torch.tensor([len(prompt) for prompt in unique], device=device)
    occupied = torch.cat(
        [
            (torch.arange(prompt_len, device=device) < unique_lengths[:, None]).reshape(-1),
            (steps < (ends - prompt_lengths)[:, None]).reshape(-1),
        ]
    )
    slots = occupied.nonzero().squeeze(1)
    of_row_index = torch.tensor(of_row, device=device)
    layout = SharedPrefix(
        len(unique), prompt_len, of_row_index, prompt_lengths, completion_len, slots=slots
    )
    # Each batch position's grid slot (its prompt's, or its own continuation's), then that
    # slot's place in the packed row; a position past its row's span reads any computed slot
    # (the first): nothing reads it.
    in_prompt = of_row_index[:, None] * prompt_len + columns
    offset = (columns - prompt_lengths[:, None]).clamp(0, completion_len - 1)
    in_completion = (
        len(unique) * prompt_len
        + torch.arange(rows, device=device)[:, None] * completion_len
        + offset
    )
    grid_index = torch.where(columns < prompt_lengths[:, None], in_prompt, in_completion)
    packed_index = torch.zeros(occupied.numel(), dtype=torch.long, device=device)
    packed_index[slots] = torch.arange(slots.numel(), device=device)
    index = packed_index[grid_index]  # [rows, seq]: each position's place in the packed row
    # A prompt's last position, scored in each row continuing it, is wanted once per row.
    wanted = {} if positions is None else {"rows": index.reshape(-1).index_select(0, positions)}
    out = model(
        grid_tokens[slots][None],
        input_pos=grid_positions[slots][None],
        shared_prefix=layout,
        return_hidden=return_hidden,
        **wanted,
    )
    return out if positions is not None else out[0][index]


def forward_sharing_prompts(
    model: nn.Module, batch: dict[str, torch.Tensor], output: OutputLayer | None = None
) -> torch.Tensor:
    """:func:`~tunelab.training.forward` of a labelled batch, each shared prompt computed once.

    Falls back to the per-row forward where :func:`shared_prompt_forward` does not apply.

    Returns:
        Logits ``[rows, seq, ...]`` (final hidden states with ``output``), equal to the per-row
        forward's at every position up to each row's last label; the per-row fallback with
        ``output`` the hidden states of the scored positions only (``[scored, dim]``, see
        :func:`~tunelab.training.forward`), which the losses take alike, and so does the
        shared forward where the layout allows it.
    """
    scored = scored_rows_only(model, batch, output)
    out = shared_prompt_forward(
        model, batch, return_hidden=output is not None, positions=scored.get("rows")
    )
    return forward(model, batch, output) if out is None else out
