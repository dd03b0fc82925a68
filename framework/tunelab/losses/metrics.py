"""Preference metrics as sums, reduced once over micro-batches and ranks.

A metric averaged per micro-batch and then averaged again over ranks is wrong as soon as
micro-batches differ in size. Here every micro-batch contributes sums and a count; the
recipe adds them up (:func:`accumulate_metrics`) and :func:`reduce_metrics` all-reduces
sums and count in one collective and divides once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from tunelab.errors import TunelabError

__all__ = ["COUNT_KEY", "accumulate_metrics", "preference_metrics", "reduce_metrics"]

COUNT_KEY = "count"
"""Key of the number of pairs in :func:`preference_metrics`' output."""


def preference_metrics(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    chosen_mean_logits: torch.Tensor,
    rejected_mean_logits: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Sums of the preference metrics over the pairs of one micro-batch.

    Names follow TRL: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``
    (chosen reward strictly above rejected), ``rewards/margins`` (chosen - rejected),
    ``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected``, plus
    ``count`` (:data:`COUNT_KEY`), the number of pairs.

    Args:
        chosen_rewards: ``[batch]`` from the preference loss.
        rejected_rewards: ``[batch]`` from the preference loss.
        policy_chosen_logps: ``[batch]`` summed completion log-probs of the policy.
        policy_rejected_logps: ``[batch]`` the same for the rejected completions.
        chosen_mean_logits: ``[batch]`` mean completion logits from :func:`sequence_logps`.
        rejected_mean_logits: ``[batch]`` the same for the rejected completions.

    Returns:
        A dict of detached 0-dim fp32 tensors, each a sum over the batch.
    """
    with torch.no_grad():
        values = {
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/accuracies": chosen_rewards > rejected_rewards,
            "rewards/margins": chosen_rewards - rejected_rewards,
            "logps/chosen": policy_chosen_logps,
            "logps/rejected": policy_rejected_logps,
            "logits/chosen": chosen_mean_logits,
            "logits/rejected": rejected_mean_logits,
        }
        sums = {name: value.detach().float().sum() for name, value in values.items()}
        sums[COUNT_KEY] = torch.tensor(float(chosen_rewards.numel()), device=chosen_rewards.device)
    return sums


def accumulate_metrics(
    total: Mapping[str, torch.Tensor] | None, new: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Add one micro-batch's metric sums to a running total.

    Args:
        total: the running total, or None for the first micro-batch.
        new: this micro-batch's sums (same keys).

    Returns:
        A new dict with the element-wise sums.
    """
    if total is None:
        return dict(new)
    return {name: total[name] + value for name, value in new.items()}


def reduce_metrics(
    sums: Mapping[str, torch.Tensor | float],
    count: torch.Tensor | float,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Global means: all-reduce the sums and the count, then divide once.

    The reduction is one all-reduce of a stacked float64 tensor on the device of the sums,
    when ``torch.distributed`` is initialised; otherwise the local values are used.

    Args:
        sums: metric name to local sum. A :data:`COUNT_KEY` entry is left out of the result.
        count: local number of items the sums run over (pairs, tokens).
        process_group: group to reduce over; None means the default group.

    Returns:
        Metric name to global mean, as Python floats (rank-identical).

    Raises:
        TunelabError: if the global count is 0 (nothing was measured).
    """
    names = [name for name in sums if name != COUNT_KEY]
    device = next(
        (value.device for value in (*sums.values(), count) if isinstance(value, torch.Tensor)),
        torch.device("cpu"),
    )
    stacked = torch.stack(
        [torch.as_tensor(sums[name], dtype=torch.float64, device=device) for name in names]
        + [torch.as_tensor(count, dtype=torch.float64, device=device)]
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=process_group)
    *totals, total_count = stacked.tolist()
    if total_count == 0:
        raise TunelabError("cannot average metrics over a count of 0 items across all ranks")
    return {name: total / total_count for name, total in zip(names, totals)}
