"""ORPO: the odds-ratio preference term added to SFT's NLL, with no reference model."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tunelab.errors import TunelabError
from tunelab.losses.preference import LossOutput, PreferenceLoss, _positive

__all__ = ["ORPOLoss"]

_MINUS_LN2 = -math.log(2.0)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate on both sides of ``-ln 2`` (Maechler 2012)."""
    return torch.where(x < _MINUS_LN2, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class ORPOLoss(PreferenceLoss):
    """ORPO (Hong et al. 2024, arXiv:2403.07691): one stage, no reference model.

    With ``a = pi / len`` the length-averaged log-prob of a completion (``exp(a)`` is the
    paper's ``P(y | x)``) and ``odds(y) = P / (1 - P)``::

        log_odds = (a_c - a_r) - (log(1 - exp(a_c)) - log(1 - exp(a_r)))
        loss     = NLL(chosen) - beta * logsigmoid(log_odds)

    ``NLL(chosen)`` is the mean over the chosen completion tokens of ``-log p``: over the
    whole optimizer step (all micro-batches and ranks) when the recipe passes
    ``chosen_tokens_per_pair``, over this batch otherwise (TRL's per-micro-batch mean). So the
    per-pair loss is ``-pi_c / chosen_tokens_per_pair - beta * logsigmoid(log_odds)``: summed
    over the step's pairs and divided by their number it is the token-mean NLL plus the mean
    odds-ratio term. ``beta`` is the paper's ``lambda`` and TRL's ``beta``. TRL's ORPOTrainer
    also puts the prompt tokens into the NLL; here, as in the paper, only the answer's.
    Rewards (as TRL's): ``beta * a``.

    Args:
        beta: weight of the odds-ratio term.

    Raises:
        ConfigError: if ``beta <= 0``.
    """

    needs_reference = False
    length_normalized = True
    adds_chosen_nll = True

    def __init__(self, beta: float = 0.1) -> None:
        super().__init__()
        self.beta = _positive("beta", beta)

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
        """Per-pair ORPO losses and rewards (see :meth:`PreferenceLoss.forward`).

        The reference log-probs are ignored. ``chosen_tokens_per_pair``: the step's chosen
        completion tokens divided by its pairs (both global); None: this batch's.

        Raises:
            TunelabError: if the completion lengths are missing.
        """
        if chosen_lengths is None or rejected_lengths is None:
            raise TunelabError("ORPOLoss is length-normalised and needs the completion lengths")
        chosen_scale = chosen_lengths.clamp(min=1).to(policy_chosen_logps.dtype)
        rejected_scale = rejected_lengths.clamp(min=1).to(policy_rejected_logps.dtype)
        mean_chosen = policy_chosen_logps / chosen_scale
        mean_rejected = policy_rejected_logps / rejected_scale
        log_odds = (mean_chosen - mean_rejected) - (
            _log1mexp(mean_chosen) - _log1mexp(mean_rejected)
        )
        if chosen_tokens_per_pair is None:
            chosen_tokens_per_pair = chosen_lengths.sum() / chosen_lengths.numel()
        tokens_per_pair = chosen_tokens_per_pair.to(policy_chosen_logps.dtype).clamp(min=1)
        losses = -policy_chosen_logps / tokens_per_pair - self.beta * F.logsigmoid(log_odds)
        return losses, self.beta * mean_chosen.detach(), self.beta * mean_rejected.detach()
