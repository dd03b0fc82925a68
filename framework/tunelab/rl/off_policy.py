"""Corrections for rollouts sampled by an older policy (asynchronous GRPO, ``rollout.mode: async``).

With ``rollout.max_lag`` k > 0 the completions trained on at step t were sampled by the policy
of step ``t - k`` (the *behaviour* policy ``mu``), while the loss's ratio is taken against the
trainer's own log-probs at step t (the *proximal* policy ``pi_old``, detached). The gap is
corrected per completion token with an importance weight on the token loss::

    rho_it = exp(logp_old_it - logp_mu_it)          trainer vs behaviour, both detached
    L_it   = w(rho_it) * l_it                       l_it: the policy loss's token loss

(decoupled PPO, Hilton et al. 2022, arXiv:2110.00641; truncated importance sampling for a
rollout engine that differs from the trainer, Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training"). ``logp_mu`` is recorded while sampling, never
recomputed (:attr:`tunelab.rl.ModelRolloutEngine.last_logps`). A correction is a
:class:`OffPolicyCorrection` chosen with ``rollout.off_policy: {_component_: ...}``:

    TruncatedIS (TIS):  w = min(rho, cap)
    MaskedIS:           w = rho if low <= rho <= high else 0    (the token leaves the loss)

:func:`behaviour_sums` gives the health metrics logged every step in every mode: the mean and
spread of ``log rho`` and the k3 estimate of ``KL(mu || pi_old)`` over the behaviour's samples,
``mean(rho - 1 - log rho)`` (about 1e-7 at lag 0, where only rounding separates the sampling
forward from the training forward).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tunelab.errors import ConfigError

__all__ = ["MaskedIS", "OffPolicyCorrection", "TruncatedIS", "behaviour_sums", "check_correction"]


class OffPolicyCorrection(ABC):
    """Base of the importance weights that correct a lagged behaviour policy (see the module doc).

    A new correction is one subclass implementing :meth:`weights`, chosen in a config with
    ``rollout.off_policy: {_component_: my_module.MyCorrection, ...}``.
    """

    @abstractmethod
    def weights(self, log_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The token weights and the tokens whose weight was cut.

        Args:
            log_ratio: ``[rows, tokens]`` ``logp_old - logp_mu`` (detached).

        Returns:
            ``(weights, cut)``: ``[rows, tokens]`` weights in the log-ratio's dtype, and a bool
            tensor marking the tokens the correction truncated or masked (counted in
            ``off_policy/clip_fraction``).
        """


@dataclass(frozen=True)
class TruncatedIS(OffPolicyCorrection):
    """Truncated importance sampling: ``w = min(exp(logp_old - logp_mu), cap)``.

    Args:
        cap: The largest weight (TIS's C; 2.0 as in Yao et al. 2025).
    """

    cap: float = 2.0

    def __post_init__(self) -> None:
        if not self.cap > 0:
            raise ValueError(f"TruncatedIS: cap must be above 0, got {self.cap}")

    def weights(self, log_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``min(rho, cap)``; ``cut`` where ``rho > cap``."""
        ratio = torch.exp(log_ratio)
        return ratio.clamp(max=self.cap), ratio > self.cap


@dataclass(frozen=True)
class MaskedIS(OffPolicyCorrection):
    """Masked importance sampling: ``w = rho`` inside ``[low, high]``, 0 outside.

    A token whose behaviour probability is far from the trainer's leaves the loss instead of
    being down-weighted (the masked variant of Yao et al. 2025).

    Args:
        low: The smallest ratio kept.
        high: The largest ratio kept.
    """

    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.low <= 1 <= self.high:
            raise ValueError(
                f"MaskedIS: need 0 <= low <= 1 <= high, got low {self.low}, high {self.high}"
            )

    def weights(self, log_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rho`` where ``low <= rho <= high``, else 0; ``cut`` outside."""
        ratio = torch.exp(log_ratio)
        cut = (ratio < self.low) | (ratio > self.high)
        return ratio.masked_fill(cut, 0.0), cut


def behaviour_sums(
    logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """fp64 sums over the masked tokens of the trainer-vs-behaviour log ratio (for the metrics).

    ``d = logp_old - logp_mu``: ``log_ratio`` sums ``d``, ``log_ratio_squares`` ``d**2``, and
    ``kl`` Schulman's k3 estimator of ``KL(mu || pi_old)`` over the behaviour's samples,
    ``exp(d) - d - 1`` with ``exp(d) = pi_old / mu`` (never negative, and unbiased because the
    tokens were drawn from ``mu``: ``E_mu[exp(d)] = 1``, ``E_mu[-d] = KL(mu || pi_old)``). The
    mirrored ``exp(-d) + d - 1`` is k3 for samples of ``pi_old``; over ``mu``'s samples its
    mean is ``chi2(mu || pi_old) - KL(mu || pi_old)``, which a few tokens that ``pi_old`` has
    made unlikely blow up.
    """
    delta = (logps.detach().double() - behaviour_logps.double()).masked_fill(~mask, 0.0)
    return {
        "log_ratio": delta.sum(),
        "log_ratio_squares": (delta**2).sum(),
        "kl": (torch.exp(delta) - delta - 1).sum(),
    }


def check_correction(correction: object) -> OffPolicyCorrection:
    """``correction`` if it is an :class:`OffPolicyCorrection`, else one clear error.

    Raises:
        ConfigError: The configured ``rollout.off_policy`` is something else.
    """
    if not isinstance(correction, OffPolicyCorrection):
        raise ConfigError(
            "rollout.off_policy: needs a subclass of tunelab.rl.OffPolicyCorrection "
            f"(tunelab.rl.TruncatedIS, tunelab.rl.MaskedIS), got {type(correction).__name__}"
        )
    return correction
