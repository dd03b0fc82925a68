"""The DPO family of preference losses.

Every loss takes per-pair summed completion log-probs (from :func:`sequence_logps`) and
returns per-pair losses and rewards, so the recipe sums them and divides once by the
global number of pairs. Notation, per pair:

    pi_c, pi_r    policy log-probs of the chosen / rejected completion (summed over tokens)
    ref_c, ref_r  the same under the frozen reference model
    len_c, len_r  number of completion tokens
    h = (pi_c - ref_c) - (pi_r - ref_r)

Rewards follow TRL's conventions, so the logged numbers compare with what users know:
``reward = beta * (pi - ref)`` on the same (summed or length-averaged) log-probs the loss
uses, detached. Each class says whether it needs the reference forward
(``needs_reference``), whether it divides log-probs by length (``length_normalized``) and
whether it adds the chosen answer's token-mean NLL (``adds_chosen_nll``, ORPO), for which the
recipe passes the step's ``chosen_tokens_per_pair``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tunelab.errors import ConfigError, TunelabError

__all__ = ["DPOLoss", "HingeLoss", "IPOLoss", "PreferenceLoss", "SimPOLoss"]

LossOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"loss.{name} must be a positive number, got {value!r}")
    return float(value)


class PreferenceLoss(nn.Module):
    """Base of the DPO family: argument checks and length normalisation.

    Subclasses set ``needs_reference`` and ``length_normalized`` and implement
    ``_loss(pi_c, pi_r, ref_c, ref_r) -> (losses, chosen_rewards, rejected_rewards)`` on
    log-probs that are already length-normalised when ``length_normalized`` is True.
    """

    needs_reference: bool = True
    length_normalized: bool = False
    adds_chosen_nll: bool = False

    def forward(
        self,
        policy_chosen_logps: torch.Tensor,
        policy_rejected_logps: torch.Tensor,
        reference_chosen_logps: torch.Tensor | None = None,
        reference_rejected_logps: torch.Tensor | None = None,
        chosen_lengths: torch.Tensor | None = None,
        rejected_lengths: torch.Tensor | None = None,
        chosen_tokens_per_pair: torch.Tensor | None = None,
    ) -> LossOutput:
        """Compute per-pair losses and rewards.

        Args:
            policy_chosen_logps: ``[batch]`` summed completion log-probs of the policy.
            policy_rejected_logps: ``[batch]`` the same for the rejected completions.
            reference_chosen_logps: ``[batch]`` reference log-probs; None when
                ``needs_reference`` is False (and ignored then).
            reference_rejected_logps: ``[batch]`` the same for the rejected completions.
            chosen_lengths: ``[batch]`` completion token counts; needed when
                ``length_normalized``. A zero length is treated as 1.
            rejected_lengths: ``[batch]`` the same for the rejected completions.
            chosen_tokens_per_pair: The step's chosen completion tokens per pair (0-dim,
                global); used only by losses with ``adds_chosen_nll`` (ORPO).

        Returns:
            ``(losses, chosen_rewards, rejected_rewards)``, each ``[batch]``; rewards are
            detached.

        Raises:
            TunelabError: if the reference log-probs or the lengths this loss needs are
                missing.
        """
        name = type(self).__name__
        if self.needs_reference:
            if reference_chosen_logps is None or reference_rejected_logps is None:
                raise TunelabError(
                    f"{name} needs reference log-probs; run the reference forward when "
                    "loss.needs_reference is True"
                )
        else:
            reference_chosen_logps = reference_rejected_logps = None
        if self.length_normalized:
            if chosen_lengths is None or rejected_lengths is None:
                raise TunelabError(f"{name} is length-normalised and needs the completion lengths")
            chosen_scale = chosen_lengths.clamp(min=1).to(policy_chosen_logps.dtype)
            rejected_scale = rejected_lengths.clamp(min=1).to(policy_rejected_logps.dtype)
            policy_chosen_logps = policy_chosen_logps / chosen_scale
            policy_rejected_logps = policy_rejected_logps / rejected_scale
            if reference_chosen_logps is not None:
                reference_chosen_logps = reference_chosen_logps / chosen_scale
                reference_rejected_logps = reference_rejected_logps / rejected_scale
        return self._loss(
            policy_chosen_logps,
            policy_rejected_logps,
            reference_chosen_logps,
            reference_rejected_logps,
        )

    def _loss(
        self,
        pi_c: torch.Tensor,
        pi_r: torch.Tensor,
        ref_c: torch.Tensor | None,
        ref_r: torch.Tensor | None,
    ) -> LossOutput:
        raise NotImplementedError


def _margin_and_rewards(
    scale: float, pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    chosen_ratio = pi_c - ref_c
    rejected_ratio = pi_r - ref_r
    h = chosen_ratio - rejected_ratio
    return h, scale * chosen_ratio.detach(), scale * rejected_ratio.detach()


class DPOLoss(PreferenceLoss):
    """Sigmoid DPO (Rafailov et al. 2023, arXiv:2305.18290), with conservative DPO smoothing.

    ``loss = -(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)``.
    ``eps = label_smoothing`` is the assumed probability that a preference label is flipped
    (cDPO, Mitchell 2023); ``eps = 0`` is plain DPO. Rewards: ``beta * (pi - ref)``.

    Args:
        beta: inverse temperature; how far the policy may move from the reference.
        label_smoothing: ``eps`` in ``[0, 0.5)``.

    Raises:
        ConfigError: if ``beta <= 0`` or ``label_smoothing`` is outside ``[0, 0.5)``.
    """

    needs_reference = True
    length_normalized = False

    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.beta = _positive("beta", beta)
        if (
            isinstance(label_smoothing, bool)
            or not isinstance(label_smoothing, (int, float))
            or not 0.0 <= label_smoothing < 0.5
        ):
            raise ConfigError(f"loss.label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
        self.label_smoothing = float(label_smoothing)

    def _loss(
        self,
        pi_c: torch.Tensor,
        pi_r: torch.Tensor,
        ref_c: torch.Tensor | None,
        ref_r: torch.Tensor | None,
    ) -> LossOutput:
        h, chosen_rewards, rejected_rewards = _margin_and_rewards(
            self.beta, pi_c, pi_r, ref_c, ref_r
        )
        eps = self.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(self.beta * h) - eps * F.logsigmoid(-self.beta * h)
        return losses, chosen_rewards, rejected_rewards


class IPOLoss(PreferenceLoss):
    """IPO (Azar et al. 2023, arXiv:2310.12036) on length-averaged log-probs.

    ``loss = (h - 1 / (2 * tau))^2`` where every log-prob is divided by its completion
    length first (as in TRL). The squared loss regresses the margin to a fixed target
    instead of pushing it to infinity, so it does not overfit deterministic preferences.
    Rewards: ``tau * (pi / len - ref / len)`` (TRL uses its ``beta`` as ``tau``).

    Args:
        tau: regularisation strength; the target margin is ``1 / (2 tau)``.

    Raises:
        ConfigError: if ``tau <= 0``.
    """

    needs_reference = True
    length_normalized = True

    def __init__(self, tau: float = 0.1) -> None:
        super().__init__()
        self.tau = _positive("tau", tau)

    def _loss(
        self,
        pi_c: torch.Tensor,
        pi_r: torch.Tensor,
        ref_c: torch.Tensor | None,
        ref_r: torch.Tensor | None,
    ) -> LossOutput:
        h, chosen_rewards, rejected_rewards = _margin_and_rewards(
            self.tau, pi_c, pi_r, ref_c, ref_r
        )
        losses = (h - 1.0 / (2.0 * self.tau)) ** 2
        return losses, chosen_rewards, rejected_rewards


class HingeLoss(PreferenceLoss):
    """Hinge loss on the DPO margin, as in SLiC (Zhao et al. 2023, arXiv:2305.10425).

    ``loss = relu(1 - beta * h)``: zero once the scaled margin exceeds 1.
    Rewards: ``beta * (pi - ref)`` on summed log-probs.

    Args:
        beta: scale of the margin; ``1 / beta`` is the margin the loss asks for.

    Raises:
        ConfigError: if ``beta <= 0``.
    """

    needs_reference = True
    length_normalized = False

    def __init__(self, beta: float = 0.1) -> None:
        super().__init__()
        self.beta = _positive("beta", beta)

    def _loss(
        self,
        pi_c: torch.Tensor,
        pi_r: torch.Tensor,
        ref_c: torch.Tensor | None,
        ref_r: torch.Tensor | None,
    ) -> LossOutput:
        h, chosen_rewards, rejected_rewards = _margin_and_rewards(
            self.beta, pi_c, pi_r, ref_c, ref_r
        )
        losses = torch.relu(1.0 - self.beta * h)
        return losses, chosen_rewards, rejected_rewards


class SimPOLoss(PreferenceLoss):
    """SimPO (Meng et al. 2024, arXiv:2405.14734): reference-free and length-normalised.

    ``loss = -logsigmoid(beta * (pi_c / len_c - pi_r / len_r) - gamma)``. The average
    log-prob is the implicit reward, so no reference model runs; ``gamma`` is a target
    reward margin. Rewards: ``beta * pi / len``.

    Args:
        beta: reward scale.
        gamma: target margin subtracted inside the sigmoid (the paper's ``gamma``, not
            ``gamma / beta``).

    Raises:
        ConfigError: if ``beta <= 0``.
    """

    needs_reference = False
    length_normalized = True

    def __init__(self, beta: float = 2.0, gamma: float = 0.5) -> None:
        super().__init__()
        self.beta = _positive("beta", beta)
        self.gamma = float(gamma)

    def _loss(
        self,
        pi_c: torch.Tensor,
        pi_r: torch.Tensor,
        ref_c: torch.Tensor | None,
        ref_r: torch.Tensor | None,
    ) -> LossOutput:
        losses = -F.logsigmoid(self.beta * (pi_c - pi_r) - self.gamma)
        return losses, self.beta * pi_c.detach(), self.beta * pi_r.detach()
