"""Group-relative policy-gradient losses: GRPO, DAPO and Dr. GRPO, with an optional k3 KL.

For each prompt the policy samples a group of ``G`` completions ``o_1..o_G``, a program scores
them (rewards ``r_i``), and each completion's tokens are pushed up or down by its
**group-relative advantage** (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300, eq. 3)::

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)      scale_rewards=True (GRPO, DAPO)
    A_i =  r_i - mean(r_1..r_G)                               scale_rewards=False (Dr. GRPO)

(``std`` with Bessel's correction, as TRL's ``GRPOTrainer``; Dr. GRPO, Liu et al. 2025,
arXiv:2503.20783, drops the division because it weighs easy and hard questions unequally.)

Per completion token ``t`` of ``o_i``, with the importance ratio against the policy that
sampled the rollouts ``rho_it = exp(logp_it - old_logp_it)``, the clipped surrogate (PPO,
Schulman et al. 2017) with separate low and high clip ranges (DAPO's clip-higher, Yu et al.
2025, arXiv:2503.14476, eq. 8)::

    l_it = -min(rho_it * A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) * A_i) + beta * k3_it
    k3_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1        (Schulman's k3 estimator of
                                                                    KL(pi || pi_ref), GRPO eq. 4)

and the token losses are aggregated over the batch of ``N`` completions (lengths ``|o_i|``)::

    sequence_mean (GRPO eq. 3):      L = 1/N * sum_i 1/|o_i| * sum_t l_it
    token_mean (DAPO eq. 8):         L = 1/sum_i |o_i| * sum_i sum_t l_it
    constant_length (Dr. GRPO):      L = 1/(N * max_new_tokens) * sum_i sum_t l_it

The denominators span the whole optimizer step (every micro-batch, every rank), so a micro-batch
returns only its **sum** (:meth:`GRPOLoss.loss_sum`); the recipe divides by
:func:`loss_normalizer` of the step's global counts, which makes the loss the same at any world
size and accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from tunelab.losses._token_logps import OutputLayer, hidden_target_logps, target_logps

__all__ = ["GRPOLoss", "group_advantages", "loss_normalizer", "token_logps"]

Aggregation = Literal["sequence_mean", "token_mean", "constant_length"]
AGGREGATIONS = ("sequence_mean", "token_mean", "constant_length")


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale_rewards: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Group-relative advantages of consecutive groups of ``group_size`` rewards.

    Args:
        rewards: ``[num_groups * group_size]``, each group's completions consecutive.
        group_size: Completions per prompt (``G``, at least 2 for a std).
        scale_rewards: Divide by the group's std (+ ``eps``); False for Dr. GRPO.
        eps: Added to the std, so a group of equal rewards gets advantages 0, not NaN.

    Returns:
        ``[num_groups * group_size]`` advantages in the rewards' dtype.

    Raises:
        ValueError: If the rewards do not split into whole groups.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be [groups * {group_size}], got shape {tuple(rewards.shape)}"
        )
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_rewards:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def loss_normalizer(
    aggregation: Aggregation, *, num_sequences: int, num_tokens: int, max_new_tokens: int
) -> int:
    """The denominator of an aggregation, from the step's global counts (see the module doc).

    Args:
        aggregation: ``sequence_mean``, ``token_mean`` or ``constant_length``.
        num_sequences: Completions in the optimizer step, over all ranks.
        num_tokens: Their completion tokens, over all ranks.
        max_new_tokens: The generation limit (Dr. GRPO's constant length).

    Returns:
        The divisor of the summed :meth:`GRPOLoss.loss_sum` (at least 1).
    """
    if aggregation == "sequence_mean":
        return max(num_sequences, 1)
    if aggregation == "token_mean":
        return max(num_tokens, 1)
    if aggregation == "constant_length":
        return max(num_sequences * max_new_tokens, 1)
    raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")


def token_logps(
    hidden_or_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    output: OutputLayer | None = None,
    ignore_index: int = -100,
    num_chunks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the completion tokens, the output layer applied chunk by chunk.

    With ``output`` (the model's output layer) the input is the final hidden states and only
    positions with a label go through the output layer: the ``[batch, seq, vocab]`` logits
    never exist (see :class:`OutputLayer`).

    Args:
        hidden_or_logits: ``[batch, seq, dim]`` hidden states with ``output``, else logits.
        labels: ``[batch, seq]`` aligned with the tokens, ``ignore_index`` where not scored.
        output: The model's output layer, or None when logits are given.
        ignore_index: Label of positions that are not completion tokens.
        num_chunks: Pieces of the fp32 log-softmax (None: by size).

    Returns:
        ``(logps, mask)``, each ``[batch, seq - 1]``: log-probs in fp32 (0 where not scored,
        differentiable) and the bool mask of scored positions.
    """
    if output is None:
        return target_logps(hidden_or_logits, labels, ignore_index, num_chunks)
    logps, mask, _ = hidden_target_logps(
        hidden_or_logits, output, labels, ignore_index, num_chunks, with_logit_sums=False
    )
    return logps, mask


@dataclass(frozen=True)
class GRPOLoss:
    """The clipped, group-relative policy-gradient loss of GRPO / DAPO / Dr. GRPO.

    Args:
        clip_eps_low: ``eps_low``: the ratio is clipped below at ``1 - eps_low``.
        clip_eps_high: ``eps_high``: clipped above at ``1 + eps_high`` (DAPO: 0.28 > 0.2).
        beta: Weight of the k3 KL to the reference (0: no reference forward needed).
        aggregation: ``sequence_mean`` (GRPO), ``token_mean`` (DAPO) or ``constant_length``
            (Dr. GRPO).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    beta: float = 0.0
    aggregation: Aggregation = "sequence_mean"

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}"
            )

    def token_losses(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logps: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``l_it`` of every completion token (0 elsewhere) and the micro-batch's metric sums.

        Args:
            logps: ``[batch, tokens]`` the policy's log-probs (differentiable).
            old_logps: ``[batch, tokens]`` those of the policy that sampled (detached).
            advantages: ``[batch]``.
            mask: ``[batch, tokens]`` bool, True at completion tokens.
            ref_logps: ``[batch, tokens]`` the reference's; required when ``beta > 0``.

        Returns:
            ``(losses, sums)``: ``[batch, tokens]`` token losses, and detached fp64 sums over
            the completion tokens: ``clipped`` (tokens whose clipped term was the one taken
            and differs from the unclipped: no gradient), ``kl`` (the k3 values; 0 without a
            reference).
        """
        if self.beta > 0 and ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probs")
        ratio = torch.exp(logps - old_logps)
        advantage = advantages.to(logps.dtype)[:, None]
        unclipped = ratio * advantage
        clipped = torch.clamp(ratio, 1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantage
        losses = -torch.minimum(unclipped, clipped)
        sums = {"clipped": (clipped < unclipped) & mask}
        if ref_logps is not None:
            delta = ref_logps - logps
            kl = torch.exp(delta) - delta - 1
            if self.beta > 0:
                losses = losses + self.beta * kl
            sums["kl"] = kl.detach().double().mul(mask)
        losses = losses * mask
        return losses, {key: value.double().sum() for key, value in sums.items()}

    def loss_sum(self, losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The micro-batch's share of the numerator: divide by :func:`loss_normalizer`.

        ``sequence_mean`` sums each completion's mean token loss; the other two sum every
        token loss.
        """
        if self.aggregation == "sequence_mean":
            lengths = mask.sum(dim=-1).clamp(min=1)
            return (losses.sum(dim=-1) / lengths).sum()
        return losses.sum()
