"""Building blocks of the KTO step: the KL estimate, the completion forward, loss and metrics.

The step itself is in ``recipes/kto_distributed.py``. A ``padded_collate_kto`` micro-batch has
the layout of a preference batch: rows ``0..B-1`` are the labelled completions (prompt ``x_i``,
completion ``y_i``), rows ``B..2B-1`` their mismatched pairs (``x_i`` with another row's
completion), so the reference machinery of DPO (``step_references``, ``PrecomputedReference``)
serves unchanged: its ``chosen_logps`` are the completions', its ``rejected_logps`` the
mismatched pairs'. Per optimizer step:

1. reference log-probs of both halves of every micro-batch (one swap), and the policy's of
   the mismatched halves, all without gradient;
2. ``z0`` (:func:`step_kl`): ``max(0, mean(pi' - ref'))`` over every mismatched pair of the step
   on all ranks, one all-reduce. TRL averages per micro-batch over ranks; over the whole step
   it is the same with one micro-batch, and with accumulation it is what makes the step
   independent of how it is split (2 processes equal 1 process with twice the accumulation);
3. per micro-batch, the policy forward of the completions (with gradient) and their losses,
   summed and divided by the step's global number of rows (:func:`global_pair_count`).

A step of one micro-batch folds 1 and 3 for the policy into one forward with gradient of the
whole batch (:func:`kto_forward`): each prompt runs once for its completion and its mismatched
pair, whose log-probs are detached for ``z0`` before the loss.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.data import DataLoader

from tunelab.distributed import all_reduce_sum
from tunelab.errors import ConfigError, DataError
from tunelab.losses import OutputLayer, UnpairedPreferenceLoss, reduce_metrics, sequence_logps
from tunelab.losses.metrics import COUNT_KEY
from tunelab.training.loop import forward, to_device
from tunelab.training.reference import (
    PolicyOutput,
    ReferenceLogps,
    ReferenceModel,
    num_pairs,
    policy_forward,
    reshard_all,
)

logger = logging.getLogger(__name__)

_TOKENS_KEY = "num_tokens"
_DESIRABLE_KEY = "count/desirable"
# Metrics averaged over the desirable (chosen) or undesirable (rejected) rows only.
_PER_LABEL = ("rewards", "logps")


def check_unpaired_loss(loss_fn: object, recipe: str) -> UnpairedPreferenceLoss:
    """``loss_fn`` if it is an unpaired preference loss (KTO), else one clear error.

    Raises:
        ConfigError: If the configured ``loss`` is not an ``UnpairedPreferenceLoss``.
    """
    if not isinstance(loss_fn, UnpairedPreferenceLoss):
        raise ConfigError(
            f"loss: {recipe} needs an unpaired preference loss (tunelab.losses.KTOLoss), got "
            f"{type(loss_fn).__name__}; the paired losses (DPO, ORPO, ...) train with "
            "lora_dpo_distributed"
        )
    return loss_fn


def _completions(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    rows = num_pairs(batch)
    return {"tokens": batch["tokens"][:rows], "labels": batch["labels"][:rows]}


def completion_forward(
    model: nn.Module, batch: dict[str, torch.Tensor], *, output: OutputLayer | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy's forward over a KTO batch's labelled completions only (its first half).

    Returns:
        ``(logps, lengths, mean_logits)``, each ``[rows]`` (see ``sequence_logps``).
    """
    half = _completions(batch)
    return sequence_logps(forward(model, half, output), half["labels"], output=output)


@torch.no_grad()
def mismatched_logps(
    model: nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    *,
    output: OutputLayer | None = None,
) -> list[torch.Tensor]:
    """The policy's summed log-probs of each micro-batch's mismatched pairs, without gradient.

    Each runs the whole batch as the reference does (``policy_forward``: the prompt a row and
    its mismatched pair share computed once), so that a policy equal to the reference gives
    the reference's log-probs bit for bit (``z0`` = 0 at the first step).
    """
    return [policy_forward(model, batch, output=output).rejected_logps for batch in micro_batches]


def kto_forward(
    model: nn.Module, batch: dict[str, torch.Tensor], *, output: OutputLayer | None = None
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """One forward of a whole KTO batch: the completions' log-probs and the mismatched pairs'.

    For a step of one micro-batch: the prompt each row shares with its mismatched pair runs
    once, with gradient, instead of a forward of the mismatched pairs before the step
    (:func:`mismatched_logps`) and one of the completions (:func:`completion_forward`).

    Returns:
        ``(policy, mismatched)``: the completions' ``(logps, lengths, mean_logits)`` (with
        grad) and the mismatched pairs' summed log-probs ``[rows]`` (detached), equal to
        :func:`completion_forward`'s and :func:`mismatched_logps`' up to summation order.
    """
    both = policy_forward(model, batch, output=output)
    policy = (both.chosen_logps, both.chosen_lengths, both.chosen_mean_logits)
    return policy, both.rejected_logps.detach()


def step_kl(
    policy_mismatched: list[torch.Tensor],
    references: list[PolicyOutput | ReferenceLogps | None],
) -> torch.Tensor:
    """``z0 = max(0, mean(pi' - ref'))`` over the step's mismatched pairs on all ranks.

    Args:
        policy_mismatched: :func:`mismatched_logps` of the step's micro-batches.
        references: Their reference log-probs (``rejected_logps`` are the mismatched pairs').

    Returns:
        The detached 0-dim estimate (float64), the same on every rank.
    """
    device = policy_mismatched[0].device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for policy, ref in zip(policy_mismatched, references, strict=True):
        total[0] += (policy.double() - ref.rejected_logps.double()).sum()
        total[1] += policy.numel()
    total = all_reduce_sum(total)
    return (total[0] / total[1].clamp(min=1)).clamp(min=0).detach()


def kto_loss(
    loss_fn: UnpairedPreferenceLoss,
    policy: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    reference: PolicyOutput | ReferenceLogps | None,
    desirable: torch.Tensor,
    kl: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-row losses of one micro-batch and the sums of its metrics.

    Args:
        loss_fn: An unpaired preference loss.
        policy: :func:`completion_forward` of the micro-batch.
        reference: Its reference log-probs (``chosen_logps``: the completions').
        desirable: ``[rows]`` bool labels.
        kl: The step's :func:`step_kl`.

    Returns:
        ``(losses, sums)``: the ``[rows]`` losses (with grad) and detached metric sums for
        :func:`tunelab.losses.accumulate_metrics` and :func:`global_kto_metrics`.
    """
    logps, lengths, mean_logits = policy
    reference_logps = reference.chosen_logps if reference is not None else torch.zeros_like(logps)
    losses, rewards = loss_fn(logps, reference_logps, desirable, kl.to(logps.dtype))
    with torch.no_grad():
        chosen = desirable.to(torch.float64)
        rejected = 1.0 - chosen
        sums = {
            "loss": losses.detach().double().sum(),
            "rewards/chosen": (rewards.double() * chosen).sum(),
            "rewards/rejected": (rewards.double() * rejected).sum(),
            "logps/chosen": (logps.detach().double() * chosen).sum(),
            "logps/rejected": (logps.detach().double() * rejected).sum(),
            "logits/mean": mean_logits.double().sum(),
            _DESIRABLE_KEY: chosen.sum(),
            _TOKENS_KEY: lengths.sum().double(),
            COUNT_KEY: torch.tensor(float(logps.numel()), dtype=torch.float64, device=logps.device),
        }
    return losses, sums


def global_kto_metrics(
    sums: dict[str, torch.Tensor], num_rows: torch.Tensor, kl: torch.Tensor
) -> tuple[dict[str, float], float]:
    """Means of a step's metric sums (one all-reduce), and its completion tokens.

    ``rewards/*`` and ``logps/*`` are means over the desirable (``chosen``) or undesirable
    (``rejected``) rows, left out when the step has none (as TRL does); ``rewards/margins`` is
    their difference; ``kl`` is ``z0``; the others are means over all rows.

    Args:
        sums: This rank's :func:`kto_loss` sums, accumulated over the micro-batches.
        num_rows: The step's global number of rows (:func:`global_pair_count`).
        kl: The step's :func:`step_kl`.

    Returns:
        ``(metrics, num_tokens)``, the same on every rank.
    """
    means = reduce_metrics(sums, sums[COUNT_KEY])
    share_chosen = means.pop(_DESIRABLE_KEY)
    tokens_per_row = means.pop(_TOKENS_KEY)
    for name in [key for key in means if key.split("/")[0] in _PER_LABEL]:
        share = share_chosen if name.endswith("chosen") else 1.0 - share_chosen
        value = means.pop(name)
        if share > 0:
            means[name] = value / share
    if "rewards/chosen" in means and "rewards/rejected" in means:
        means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
    means["kl"] = float(kl)
    return means, tokens_per_row * float(num_rows)


@torch.no_grad()
def evaluate_kto(
    model: nn.Module,
    loader: DataLoader,
    loss_fn: UnpairedPreferenceLoss,
    reference: ReferenceModel,
    device: torch.device,
    *,
    output: OutputLayer | None = None,
) -> dict[str, float]:
    """Loss and metrics over every row of a validation loader, ``z0`` over all of them.

    Raises:
        DataError: If the loader gives no batch.
    """
    was_training = model.training
    model.eval()
    batches = [to_device(batch, device) for batch in loader]
    if not batches:
        raise DataError(
            f"val_dataset has fewer than schedule.batch_size={loader.batch_size} rows per "
            "process; lower schedule.batch_size or add validation rows"
        )
    references = reference.logps(batches, output=output)
    policies = [policy_forward(model, batch, output=output) for batch in batches]
    kl = step_kl([policy.rejected_logps for policy in policies], references)
    sums = None
    for batch, policy, ref in zip(batches, policies, references, strict=True):
        completions = (policy.chosen_logps, policy.chosen_lengths, policy.chosen_mean_logits)
        _, batch_sums = kto_loss(loss_fn, completions, ref, batch["desirable"], kl)
        sums = batch_sums if sums is None else {k: sums[k] + v for k, v in batch_sums.items()}
    reshard_all(model)
    model.train(was_training)
    means = global_kto_metrics(sums, torch.ones(()), kl)[0]
    logger.info("validation loss %.4f", means["loss"])
    return means
