"""Group Sequence Policy Optimization (GSPO): the importance ratio and clipping per sequence.

GSPO (Zheng et al. 2025, arXiv:2507.18071, eq. 5-7) replaces GRPO's per-token ratio with one
ratio per completion ``o_i``: the geometric mean of its token ratios against the policy that
sampled it::

    s_i = exp(1/|o_i| * sum_t (logp_it - old_logp_it))
    L_i = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)
    L   = 1/N * sum_i L_i                                           (sequence_mean)

``A_i`` is the group-relative advantage (:func:`~tunelab.rl.group_advantages`). The whole
completion is clipped, or not, at once, so the clip ranges are about three orders of magnitude
narrower than GRPO's (the paper's 3e-4 and 4e-4). With ``beta`` > 0 the k3 KL to the reference
(:func:`~tunelab.rl.k3_kl`) is added per token and averaged over each completion, as in GRPO;
the paper uses none.

In the :class:`~tunelab.rl.PolicyLoss` interface every completion token carries its sequence's
``L_i``; the ``sequence_mean`` aggregation averages them over the completion's tokens, which
gives back ``L_i`` and its gradient exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tunelab.rl.policy_loss import PolicyLoss, k3_kl

__all__ = ["GSPOLoss"]


@dataclass(frozen=True)
class GSPOLoss(PolicyLoss):
    """GSPO's clipped sequence-level policy-gradient loss (aggregated ``sequence_mean``).

    Args:
        clip_eps_low: ``eps_low``: the sequence ratio is clipped below at ``1 - eps_low``.
        clip_eps_high: ``eps_high``: clipped above at ``1 + eps_high``.
        beta: Weight of the k3 KL to the reference (0, the paper's choice: no reference
            forward).
    """

    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    beta: float = 0.0

    def token_losses(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logps: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``L_i`` at every completion token of ``o_i`` (see :meth:`PolicyLoss.token_losses`).

        ``clipped`` counts the tokens of completions whose clipped term was taken (no
        gradient); ``kl`` sums the k3 values (with a reference only).
        """
        self.check_reference(ref_logps)
        lengths = mask.sum(dim=-1).clamp(min=1)
        # Masked where() rather than a product: a padded position's log-prob may be anything.
        log_ratio = torch.where(mask, logps - old_logps, 0.0).sum(dim=-1) / lengths
        ratio = torch.exp(log_ratio)
        advantage = advantages.to(logps.dtype)
        unclipped = ratio * advantage
        clipped = torch.clamp(ratio, 1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantage
        sequence_losses = -torch.minimum(unclipped, clipped)
        losses = sequence_losses[:, None].expand_as(logps)
        sums = {"clipped": (clipped < unclipped)[:, None] & mask}
        if ref_logps is not None:
            kl = k3_kl(logps, ref_logps)
            if self.beta > 0:
                losses = losses + self.beta * kl
            sums["kl"] = kl.detach().double().mul(mask)
        losses = losses * mask
        return losses, {key: value.double().sum() for key, value in sums.items()}
