"""Building blocks of the GRPO recipe's step: seeds, rollout batches, log-probs, global metrics.

The recipe (``recipes/grpo_distributed.py``) writes its step out: sample, score, compute the
advantages, then one or more optimizer passes over the rollouts. These are the parts it calls.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tunelab.distributed import all_reduce_sum
from tunelab.losses import OutputLayer, token_logps
from tunelab.modules.packed_linear import packed_frozen_linears
from tunelab.rl.off_policy import OffPolicyCorrection, behaviour_sums
from tunelab.rl.policy_loss import PolicyLoss
from tunelab.training.loop import output_layer
from tunelab.training.shared_prompts import forward_sharing_prompts

__all__ = [
    "FrozenReference",
    "Rollout",
    "behaviour_logps_batch",
    "completion_logps",
    "exact_parts",
    "exact_total",
    "global_sums",
    "policy_gradient_pass",
    "prompt_images",
    "store_logps",
    "rollout_batch",
    "sampling_seeds",
    "write_completions",
]


def packing_pays() -> bool:
    """Whether the update's passes run frozen layers on oneDNN-packed weights on this CPU.

    Packed per call, a frozen layer's forward and input gradient pay the two reorders (``W``
    and ``W^T``) on every micro-batch. On CPUs with AVX-512 (the AMD EPYC Zen 4 and Intel
    Sapphire Rapids of sessions 16-18) oneDNN's kernels win that back (issue 40's update half
    1.44-1.60x TRL's). On an AVX2-only CPU (AMD EPYC Zen 3, session 19) they do not: forward
    and input gradient at 2048 rows, 1 thread, plain ``F.linear`` against packing per call,
    65 against 69 ms (768 x 768), 145 against 183 (768 x 2048), 300 against 386 (768 x 4096).
    Decided by the CPU's kernels (``torch.backends.cpu.get_cpu_capability``), the same on
    every rank of a machine, never by timing, so 1 and N processes take the same path.
    """
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2")


def _packed(model: nn.Module) -> contextlib.AbstractContextManager[int]:
    """Run ``model``'s frozen linear layers on oneDNN-packed weights inside the block.

    Forward and input gradient, where the weights are fp32 on CPU: equal to the unpacked pass
    up to fp32 rounding (:func:`~tunelab.modules.packed_linear.packed_frozen_linears`). Each
    call packs what it multiplies and drops it: packs kept from pass to pass would hold the
    frozen base twice more (``W`` and ``W^T``) beside the rollout's merged weights, which put
    peak RSS at 0.96x TRL's on 2 processes (issue 40's bench; 0.79x packing per call). Where
    :func:`packing_pays` says no, the layers run ``F.linear`` (no layer set up: 0).
    """
    if not packing_pays():
        return contextlib.nullcontext(0)
    return packed_frozen_linears(model)


_OFF_POLICY_SUMS = ("tokens", "clipped", "log_ratio", "log_ratio_squares", "kl")
_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads nearby integers over the seed space


def sampling_seeds(
    seed: int, step: int, indices: list[int], num_generations: int, *, refill_round: int = 0
) -> list[int]:
    """One sampling seed per completion, from the run's seed, the step and the prompt's index.

    A seed depends on nothing else (not the rank, batch or world size, nor what was sampled
    before), so 1 and N processes, and a resumed run, sample the same tokens without any
    generator state in the checkpoint.

    Args:
        seed: The run's seed.
        step: The optimizer step being taken (0-based: the steps done before it).
        indices: Dataset index of each prompt.
        num_generations: Completions per prompt.
        refill_round: A dynamic-sampling refill round (0: the step's own prompts), so that a
            prompt drawn again in a refill samples other completions.

    Returns:
        ``len(indices) * num_generations`` seeds, each prompt's ``num_generations`` together.
    """
    seeds = []
    for index in indices:
        for sample in range(num_generations):
            value = seed
            parts = (step, index, sample) + ((refill_round,) if refill_round else ())
            for part in parts:
                value = (value * _MIX + part + 1) % 2**63
            seeds.append(value)
    return seeds


@dataclass
class Rollout:
    """One micro-batch of rollouts, ready for the policy-gradient passes.

    Attributes:
        batch: ``tokens`` ``[rows, seq]`` (prompt then completion, padded after) and
            ``labels`` (the completion tokens; -100 on prompt and padding).
        advantages: ``[rows]``.
        keep: ``[rows]`` bool: the rows the loss counts (dynamic sampling drops some).
        old_logps: ``[rows, seq - 1]`` the sampling policy's log-probs (``num_iterations`` >
            1), or None: the policy's own, detached (ratio 1).
        ref_logps: ``[rows, seq - 1]`` the reference's, or None (``beta`` 0).
        behaviour_logps: ``[rows, seq - 1]`` the log-probs the rollout engine recorded while
            sampling (:func:`behaviour_logps_batch`), or None (an engine that records none).
        lag: Policy updates between the policy that sampled and the one that trains (0 in
            synchronous GRPO; ``rollout.max_lag`` bounds it in asynchronous GRPO).
        correction: Weighs the token losses of a rollout sampled by an older policy (``lag``
            > 0) by the trainer-vs-behaviour ratio (``rollout.off_policy``,
            :mod:`tunelab.rl.off_policy`); set with the lag by ``RolloutPipeline.take``. None,
            or a rollout of lag 0: left as it is (the ratio is 1 up to rounding).
    """

    batch: dict[str, torch.Tensor]
    advantages: torch.Tensor
    keep: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    behaviour_logps: torch.Tensor | None = None
    lag: int = 0
    correction: OffPolicyCorrection | None = None


def prompt_images(prompts: Any, indices: list[int]) -> list[Any] | None:
    """Each row's images (a vision-language prompt set), read once per distinct prompt.

    Args:
        prompts: The prompt dataset (``PromptDataset``: ``images`` and ``prompt_images``).
        indices: The dataset index of each row (a group's rows repeat it).

    Returns:
        One ``{"pixel_values", "image_grid_thw"}`` (or None: a text prompt) per row, the rows of
        one prompt sharing the object (the rollout engine prefills them once); None when the
        set has no images.
    """
    if getattr(prompts, "images", None) is None:
        return None
    read: dict[int, Any] = {}
    for index in indices:
        if index not in read:
            read[index] = prompts.prompt_images(index)
    return [read[index] for index in indices]


def rollout_batch(
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    device: torch.device,
    images: list[Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Prompt + completion rows for a training forward; only completion tokens are labelled.

    Args:
        prompts: Prompt token ids, one per row.
        completions: Completion token ids, one per row.
        pad_id: Token after each row's end.
        device: Where the batch goes.
        images: Each row's images (:func:`prompt_images`), or None: the batch then carries
            ``pixel_values`` and ``image_grid_thw`` row after row, as an image chat batch does,
            so the log-prob forward sees the images the rollout engine prefilled.

    Returns:
        ``tokens`` and ``labels`` ``[rows, longest]`` (and the images).
    """
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    labels = torch.full((len(prompts), width), -100, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        tokens[row, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        labels[row, len(prompt) : len(prompt) + len(completion)] = torch.tensor(completion)
    batch = {"tokens": tokens.to(device), "labels": labels.to(device)}
    held = [item for item in images or () if item is not None]
    if held:
        for key in held[0]:  # pixel_values, image_grid_thw
            batch[key] = torch.cat([item[key] for item in held]).to(device)
    return batch


def behaviour_logps_batch(
    prompts: list[list[int]], logps: list[list[float]], width: int, device: torch.device
) -> torch.Tensor:
    """The sampling policy's recorded log-probs, aligned with :func:`completion_logps`.

    Position ``j`` of a row holds the log-prob of its token ``j + 1`` (0 where no completion
    token is predicted), as in :func:`tunelab.losses.token_logps`.

    Args:
        prompts: Prompt token ids, one per row.
        logps: The recorded log-prob of each completion token, one list per row.
        width: The :func:`rollout_batch`'s sequence length.
        device: Where the tensor goes.

    Returns:
        ``[rows, width - 1]`` float32.
    """
    out = torch.zeros((len(prompts), width - 1), dtype=torch.float32)
    for row, (prompt, values) in enumerate(zip(prompts, logps, strict=True)):
        out[row, len(prompt) - 1 : len(prompt) - 1 + len(values)] = torch.tensor(
            values, dtype=torch.float32
        )
    return out.to(device)


def completion_logps(
    model: nn.Module, batch: dict[str, torch.Tensor], output: OutputLayer | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the completion tokens of a :func:`rollout_batch`.

    With ``output`` (the model's :func:`~tunelab.training.output_layer`) only completion
    positions go through the output layer, chunk by chunk: the logits never exist whole.
    Rows that share their prompt (a GRPO group) compute it once
    (:func:`~tunelab.training.shared_prompts.shared_prompt_forward`); models or batches it does not
    apply to run the per-row forward.

    Returns:
        ``(logps, mask)`` ``[rows, seq - 1]`` (see :func:`tunelab.losses.token_logps`).
    """
    hidden = forward_sharing_prompts(model, batch, output)
    return token_logps(hidden, batch["labels"], output=output)


@torch.no_grad()
def store_logps(
    rollouts: list[Rollout],
    model: nn.Module,
    output: OutputLayer | None,
    *,
    old: bool,
    reference: Any = None,
) -> None:
    """Compute, before the first update, the log-probs the passes over ``rollouts`` reuse.

    The sampling policy's log-probs need no pass of their own: the first
    :func:`policy_gradient_pass` runs with the weights that sampled and keeps its log-probs
    (``keep_old``) for the later ones. Frozen fp32 CPU weights run packed, as in
    :func:`policy_gradient_pass`, except a :class:`FrozenReference`'s (the policy's own layers
    are trainable, so unpacked: the copy computes as they do).

    Args:
        rollouts: The step's rollouts; their ``old_logps`` and ``ref_logps`` are set.
        model: The policy.
        output: The policy's chunked output layer (None: whole logits).
        old: Store the sampling policy's log-probs in a pass of their own (for a caller whose
            first update comes before the first pass over every rollout).
        reference: A ``ReferenceModel`` or :class:`FrozenReference` (``beta`` > 0), or None;
            its output layer runs chunk by chunk when the policy's does (``output``).
    """
    with _packed(model):
        for rollout in rollouts if old else ():
            rollout.old_logps = completion_logps(model, rollout.batch, output)[0]
    if reference is None:
        return
    ref_output = output_layer(reference.model) if output is not None else None
    # Full fine-tuning's frozen copy runs as the trainable policy does (unpacked): where the
    # weights are still equal (step 1) the two log-probs, and so the KL, are equal to the bit.
    # The adapter-disabled policy packs the frozen base it shares with the policy's passes.
    frozen_copy = isinstance(reference, FrozenReference)
    with reference.active(), contextlib.nullcontext() if frozen_copy else _packed(reference.model):
        for rollout in rollouts:
            rollout.ref_logps = completion_logps(reference.model, rollout.batch, ref_output)[0]


def policy_gradient_pass(
    model: nn.Module,
    rollouts: list[Rollout],
    loss_fn: PolicyLoss,
    output: OutputLayer | None,
    *,
    scale: float,
    keep_old: bool = False,
) -> dict[str, float]:
    """One pass over the rollouts: the clipped policy-gradient loss, backward per micro-batch.

    Every rank runs a forward and backward per micro-batch, even one whose rows are all left
    out (FSDP2's collectives need them all).

    A rollout without ``old_logps`` takes the ratio against the policy's own log-probs,
    detached: in the first pass over a step's rollouts (before its first optimizer step) the
    policy is the sampling policy, so they are its log-probs, computed in this very forward.
    ``keep_old`` stores them as the rollout's ``old_logps`` for the next passes
    (``num_iterations`` > 1), which saves the separate no-grad pass over every rollout that
    :func:`store_logps` with ``old`` runs (with adapter dropout active, the ratio of the first
    pass is then exactly 1, as with one iteration).

    Args:
        model: The policy.
        rollouts: The step's rollouts (``keep`` masks the rows the loss counts).
        loss_fn: The policy loss (GRPOLoss, GSPOLoss, ...).
        output: The chunked output layer (None: whole logits).
        scale: Multiplies each micro-batch's loss sum before backward: ``world_size /
            divisor`` (FSDP2 averages gradients over ranks; the divisor is the step's global
            normalizer).
        keep_old: Store the detached log-probs as ``old_logps`` where a rollout has none
            (call it so in the first pass only, before any optimizer step on the rollouts).

    Returns:
        This rank's sums: ``loss`` (unscaled), ``clipped`` tokens, ``kl``, and over the rows
        with recorded behaviour log-probs ``off_policy/tokens``, ``off_policy/clipped``
        (tokens the correction cut) and :func:`~tunelab.rl.off_policy.behaviour_sums`.
    """
    sums = {"loss": 0.0, "clipped": 0.0, "kl": 0.0}
    sums |= {f"off_policy/{key}": 0.0 for key in _OFF_POLICY_SUMS}
    with _packed(model):
        for rollout in rollouts:
            logps, mask = completion_logps(model, rollout.batch, output)
            mask = mask & rollout.keep[:, None]
            old = rollout.old_logps if rollout.old_logps is not None else logps.detach()
            if keep_old:
                rollout.old_logps = old
            losses, metric_sums = loss_fn.token_losses(
                logps, old, rollout.advantages, mask, rollout.ref_logps
            )
            if rollout.behaviour_logps is not None:
                behaviour = rollout.behaviour_logps
                metric_sums |= {
                    f"off_policy/{key}": value
                    for key, value in behaviour_sums(old, behaviour, mask).items()
                }
                metric_sums["off_policy/tokens"] = mask.sum().double()
                if rollout.correction is not None and rollout.lag > 0:
                    weights, cut = rollout.correction.weights(
                        (old - behaviour).masked_fill(~mask, 0.0)
                    )
                    losses = losses * weights.detach()
                    metric_sums["off_policy/clipped"] = (cut & mask).sum().double()
            loss_sum = loss_fn.loss_sum(losses, mask)
            (loss_sum * scale).backward()
            sums["loss"] += loss_sum.item()
            for key, value in metric_sums.items():
                sums[key] += value.item()
    return sums


class FrozenReference:
    """The reference of full fine-tuning: a separate, frozen copy of the base model.

    The same interface as :class:`~tunelab.training.ReferenceModel` (``model`` and
    ``active()``), so a recipe runs ``with reference.active(): f(reference.model)`` either way.
    It costs a second copy of the weights (sharded like the policy's).

    Args:
        model: The base model, as built for the policy (it is frozen and put in eval mode).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model.requires_grad_(False).eval()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Nothing to switch: the copy is always the reference."""
        yield


_LIMB = "@limb"
_LIMB_QUANTA = (2.0**30, 1.0, 2.0**-30, 2.0**-60)
"""Limb ``i`` of a value is a multiple of ``_LIMB_QUANTA[i]``, below 2**30 times it but for the
first (the whole multiples of 2**30), so a sum of up to 2**23 limbs of one kind is exact."""


def exact_parts(name: str, values: torch.Tensor) -> dict[str, float]:
    """``values``' sum as limbs whose sums over micro-batches and ranks are exact.

    A float sum depends on its grouping: two processes sum a step's rewards as (rows of rank 0)
    + (rows of rank 1), one process with accumulation as (micro-batch 0) + (micro-batch 1),
    and the two round differently. Each value is cut into limbs, multiples of 2**30, 1, 2**-30
    and 2**-60 (the rest, below 2**-60, dropped), each limb a float with at most 30
    significant bits above its quantum: limbs of one kind add up exactly in any order, so
    :func:`global_sums` (or :func:`exact_total`) returns the same correctly rounded total on any
    number of processes and micro-batches (exact for sums below 2**83 of up to 2**23 values).

    Args:
        name: The metric; its limbs are the keys ``name@limb0`` ... ``name@limb3``.
        values: The values to sum (any dtype; finite).

    Returns:
        The limbs' sums, to add into a sums dict.
    """
    rest = values.detach().to(device="cpu", dtype=torch.float64).flatten()
    parts = {}
    for index, quantum in enumerate(_LIMB_QUANTA):
        limb = torch.trunc(rest / quantum) * quantum
        rest = rest - limb
        parts[f"{name}{_LIMB}{index}"] = float(limb.sum())
    return parts


def exact_total(sums: dict[str, float], name: str) -> float:
    """The correctly rounded total of ``name``'s limbs in ``sums`` (see :func:`exact_parts`)."""
    return math.fsum(sums[f"{name}{_LIMB}{index}"] for index in range(len(_LIMB_QUANTA)))


def global_sums(values: dict[str, float | torch.Tensor], device: torch.device) -> dict[str, float]:
    """Sum every value over the ranks in one all-reduce (fp64).

    Values given as limbs (:func:`exact_parts`) come back as their exact total under the
    metric's own name.
    """
    keys = list(values)
    stacked = torch.tensor([float(values[key]) for key in keys], dtype=torch.float64, device=device)
    totals = dict(zip(keys, all_reduce_sum(stacked).tolist(), strict=True))
    exact = {key.partition(_LIMB)[0] for key in keys if _LIMB in key}
    plain = {key: value for key, value in totals.items() if _LIMB not in key}
    return plain | {name: exact_total(totals, name) for name in sorted(exact)}


def write_completions(
    path: Path, step: int, records: list[dict[str, Any]], *, copies: int = 1
) -> None:
    """Append one step's completions (every rank's, gathered to rank 0) to a JSONL file.

    A collective: every rank calls it; rank 0 writes. ``copies``: consecutive ranks holding
    the same completions (a tensor-parallel group): the first of each is written.
    """
    gathered: list[Any] = [records]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        gathered = gathered[::copies]
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = sorted(
        (record for part in gathered for record in part),
        key=lambda r: (r["index"], r["sample"]),
    )
    with path.open("a") as file:
        for record in rows:
            file.write(json.dumps({"step": step, **record}) + "\n")
