"""KTO: a preference loss on unpaired completions, each labelled desirable or undesirable.

Notation, per completion ``y`` of prompt ``x``:

    pi, ref   summed completion log-probs under the policy and the frozen reference
    r = pi - ref                     the implied reward, before ``beta``
    z0 = max(0, mean(pi' - ref'))    the KL estimate: the same over mismatched pairs ``(x, y')``

``z0`` is detached (it is a reference point, not a target) and averaged over every mismatched
pair of the optimizer step, on all ranks (``tunelab.training.kto``).
"""

from __future__ import annotations

import torch
from torch import nn

from tunelab.errors import ConfigError
from tunelab.losses.preference import _positive

__all__ = ["KTOLoss", "UnpairedPreferenceLoss"]


class UnpairedPreferenceLoss(nn.Module):
    """Base of the unpaired preference losses (KTO): each row is one labelled completion.

    Subclasses implement :meth:`forward`; ``needs_reference`` says whether the reference
    forward runs (it also gives the KL estimate its reference log-probs).
    """

    needs_reference: bool = True

    def forward(
        self,
        policy_logps: torch.Tensor,
        reference_logps: torch.Tensor,
        desirable: torch.Tensor,
        kl: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row losses and rewards.

        Args:
            policy_logps: ``[rows]`` summed completion log-probs of the policy.
            reference_logps: ``[rows]`` the same under the reference.
            desirable: ``[rows]`` bool, True where the completion is labelled desirable.
            kl: 0-dim detached KL estimate ``z0``.

        Returns:
            ``(losses, rewards)``, each ``[rows]``; rewards are detached.
        """
        raise NotImplementedError


class KTOLoss(UnpairedPreferenceLoss):
    """KTO (Ethayarajh et al. 2024, arXiv:2402.01306, eq. 7), as TRL's ``loss_type="kto"``.

    ``loss = desirable_weight * (1 - sigmoid(beta * (r - z0)))`` for a desirable completion,
    ``undesirable_weight * (1 - sigmoid(beta * (z0 - r)))`` for an undesirable one. Rewards:
    ``beta * r``. Weight the two kinds so that
    ``desirable_weight * n_desirable / (undesirable_weight * n_undesirable)`` lies in
    ``[1, 4/3]`` (the paper's advice) when the data is imbalanced.

    Args:
        beta: inverse temperature, as in DPO.
        desirable_weight: weight of the desirable completions' losses.
        undesirable_weight: weight of the undesirable completions' losses.

    Raises:
        ConfigError: if a setting is not a positive number.
    """

    def __init__(
        self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
    ) -> None:
        super().__init__()
        self.beta = _positive("beta", beta)
        self.desirable_weight = _positive("desirable_weight", desirable_weight)
        self.undesirable_weight = _positive("undesirable_weight", undesirable_weight)

    def forward(
        self,
        policy_logps: torch.Tensor,
        reference_logps: torch.Tensor,
        desirable: torch.Tensor,
        kl: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row KTO losses and rewards (see :meth:`UnpairedPreferenceLoss.forward`)."""
        if desirable.dtype != torch.bool:
            raise ConfigError(f"KTOLoss: desirable must be a bool tensor, got {desirable.dtype}")
        ratio = policy_logps - reference_logps
        # Built in the log-probs' dtype: an fp32 copy of a weight such as 1.33 is off by 1e-8.
        sign = torch.ones_like(ratio).masked_fill(~desirable, -1.0)
        weight = torch.full_like(ratio, self.undesirable_weight).masked_fill(
            desirable, self.desirable_weight
        )
        losses = weight * (1.0 - torch.sigmoid(self.beta * sign * (ratio - kl)))
        return losses, self.beta * ratio.detach()
