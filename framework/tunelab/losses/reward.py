"""Pairwise losses of reward models: a scalar score per sequence, chosen above rejected.

A reward model (``tunelab.models.classifier.SequenceClassifier``) scores the chosen and the
rejected answer of each preference pair, ``r_c`` and ``r_r``; the loss pushes ``r_c`` above
``r_r``. The losses return one value per pair: the recipe sums them and divides by the step's
global number of pairs, as the DPO family does.
"""

import torch
import torch.nn.functional as F

from tunelab.losses.metrics import COUNT_KEY


class PairwiseRewardLoss:
    """A loss of a reward model's scores on preference pairs; subclasses define ``__call__``."""

    def __call__(
        self,
        chosen_rewards: torch.Tensor,
        rejected_rewards: torch.Tensor,
        margins: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-pair losses ``[pairs]`` of the scores ``[pairs]`` (and per-pair margins)."""
        raise NotImplementedError


class BradleyTerryLoss(PairwiseRewardLoss):
    """The Bradley-Terry loss of reward models, with an optional margin and centering term.

    ``loss_i = -log sigmoid(r_c - r_r - m_i) + center_rewards_coefficient * (r_c + r_r)^2``

    ``m_i`` is the pair's margin (Llama 2's margin loss, Touvron et al. 2023; 0 without a
    margin column). The centering term keeps the scores near zero mean (Eisenstein et al.
    2023, "Helping or Herding?"); its mean over pairs is TRL's
    ``center_rewards_coefficient * mean((r_c + r_r)^2)``. The model is the Bradley-Terry
    model of pairwise preference, P(c > r) = sigmoid(r_c - r_r) (Bradley and Terry, 1952;
    Ouyang et al. 2022).

    Args:
        center_rewards_coefficient: Weight of the centering term (0: none; TRL suggests 0.01).
    """

    def __init__(self, center_rewards_coefficient: float = 0.0) -> None:
        if center_rewards_coefficient < 0:
            raise ValueError(
                f"center_rewards_coefficient must be >= 0, got {center_rewards_coefficient}"
            )
        self.center_rewards_coefficient = center_rewards_coefficient

    def __call__(
        self,
        chosen_rewards: torch.Tensor,
        rejected_rewards: torch.Tensor,
        margins: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-pair losses (see the class docstring), in the scores' dtype."""
        difference = chosen_rewards - rejected_rewards
        if margins is not None:
            difference = difference - margins.to(difference.dtype)
        losses = -F.logsigmoid(difference)
        if self.center_rewards_coefficient:
            losses = (
                losses + self.center_rewards_coefficient * (chosen_rewards + rejected_rewards) ** 2
            )
        return losses


def reward_metrics(
    losses: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sums over one micro-batch's pairs of the reward model's metrics.

    ``loss``, ``accuracy`` (chosen scored strictly above rejected), ``margin`` (``r_c - r_r``),
    ``rewards/chosen``, ``rewards/rejected``, and the pair ``count``: divide by the global
    count once (``tunelab.losses.reduce_metrics``) for the means.

    Returns:
        Detached 0-dim fp64 sums.
    """
    with torch.no_grad():
        values = {
            "loss": losses,
            "accuracy": chosen_rewards > rejected_rewards,
            "margin": chosen_rewards - rejected_rewards,
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
        }
        sums = {key: value.double().sum() for key, value in values.items()}
        sums[COUNT_KEY] = torch.tensor(float(chosen_rewards.numel()), dtype=torch.float64)
        return {key: value.to(chosen_rewards.device) for key, value in sums.items()}
