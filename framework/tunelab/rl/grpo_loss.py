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
returns only its **sum** (:meth:`~tunelab.rl.PolicyLoss.loss_sum`); the recipe divides by
:meth:`~tunelab.rl.PolicyLoss.normalizer` of the step's global counts, which makes the loss the
same at any world size and accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tunelab.rl.policy_loss import AGGREGATIONS, Aggregation, PolicyLoss, k3_kl

__all__ = ["GRPOLoss"]


@dataclass(frozen=True)
class GRPOLoss(PolicyLoss):
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
        """``l_it`` of every completion token (see :meth:`PolicyLoss.token_losses`).

        ``clipped`` counts the tokens whose clipped term was the one taken and differs from the
        unclipped (no gradient); ``kl`` sums the k3 values (0 without a reference).
        """
        self.check_reference(ref_logps)
        ratio = torch.exp(logps - old_logps)
        advantage = advantages.to(logps.dtype)[:, None]
        unclipped = ratio * advantage
        clipped = torch.clamp(ratio, 1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantage
        losses = -torch.minimum(unclipped, clipped)
        sums = {"clipped": (clipped < unclipped) & mask}
        if ref_logps is not None:
            kl = k3_kl(logps, ref_logps)
            if self.beta > 0:
                losses = losses + self.beta * kl
            sums["kl"] = kl.detach().double().mul(mask)
        losses = losses * mask
        return losses, {key: value.double().sum() for key, value in sums.items()}
