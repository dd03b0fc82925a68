"""Building blocks of the reward-model step: pair scores, loss and metrics, validation.

The step itself is in ``recipes/reward_model_distributed.py``. A ``padded_collate_dpo``
micro-batch holds the chosen rows, then the rejected rows of the same pairs; one forward of the
sequence classifier scores all of them at their last token (:func:`pair_rewards`). The step
back-propagates ``sum of the micro-batch's pair losses * world_size / global number of pairs``
(``global_pair_count``), the gradient of the mean over every pair of the step whatever the
micro-batching or world size, and reduces the metric sums once (``global_preference_metrics``).
"""

import logging

import torch
from torch import nn
from torch.utils.data import DataLoader

from tunelab.errors import ConfigError
from tunelab.losses import accumulate_metrics
from tunelab.losses.reward import PairwiseRewardLoss, reward_metrics
from tunelab.models.classifier import last_token_index, sequence_scores
from tunelab.training.loop import to_device
from tunelab.training.preference import end_pair_validation
from tunelab.training.reference import num_pairs
from tunelab.training.shared_prompts import shared_prompt_forward

logger = logging.getLogger(__name__)


def check_reward_loss(loss_fn: object) -> PairwiseRewardLoss:
    """``loss_fn`` if it is a reward-model loss, else one clear error naming what it is.

    Raises:
        ConfigError: If the configured ``loss`` is not a ``PairwiseRewardLoss``.
    """
    if not isinstance(loss_fn, PairwiseRewardLoss):
        raise ConfigError(
            "loss: reward_model_distributed needs a reward-model loss "
            f"(tunelab.losses.BradleyTerryLoss), got {type(loss_fn).__name__}"
        )
    return loss_fn


def pair_rewards(
    model: nn.Module, batch: dict[str, torch.Tensor], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and rejected scores ``[pairs]`` of one forward over both sides.

    The prompt a pair's two rows share (their unlabelled prefix) is computed once
    (:func:`~tunelab.training.shared_prompts.shared_prompt_forward`, over each row's span from
    its first label to its last token, so that an unlabelled end-of-turn token is still
    scored); models that forward does not apply to, and rows with no label, run whole.
    """
    pairs = num_pairs(batch)
    tokens, labels = batch["tokens"], batch["labels"]
    slots = torch.arange(tokens.shape[1], device=tokens.device)
    last = last_token_index(tokens, pad_id)
    first = torch.where(labels != -100, slots, tokens.shape[1]).amin(dim=1)
    span = (slots >= first[:, None]) & (slots <= last[:, None])
    out = shared_prompt_forward(
        model, {"tokens": tokens, "labels": torch.where(span, tokens, -100)}, return_hidden=False
    )
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    scores = sequence_scores(model, tokens, pad_id) if out is None else out[rows, last, 0]
    return scores[:pairs], scores[pairs:]


def reward_loss(
    loss_fn: PairwiseRewardLoss, model: nn.Module, batch: dict[str, torch.Tensor], pad_id: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's per-pair losses (with grad) and the sums of its metrics.

    Args:
        loss_fn: The reward-model loss.
        model: The sequence classifier.
        batch: A ``padded_collate_dpo`` batch (with ``margin`` ``[pairs]`` when the data has
            a margin column).
        pad_id: The padding id.

    Returns:
        ``(losses, sums)``: ``[pairs]`` losses and the detached metric sums
        (``tunelab.losses.reward.reward_metrics``) with ``num_tokens``, the tokens scored.
    """
    chosen, rejected = pair_rewards(model, batch, pad_id)
    losses = loss_fn(chosen.float(), rejected.float(), batch.get("margin"))
    sums = reward_metrics(losses, chosen, rejected)
    sums["num_tokens"] = (last_token_index(batch["tokens"], pad_id) + 1).sum().double()
    return losses, sums


@torch.no_grad()
def evaluate_rewards(
    model: nn.Module,
    loader: DataLoader,
    loss_fn: PairwiseRewardLoss,
    device: torch.device,
    pad_id: int,
) -> dict[str, float]:
    """Loss, accuracy and margin averaged over every pair of a validation loader.

    Returns:
        Global means over all ranks' pairs, keyed like the training metrics.

    Raises:
        DataError: If the loader gives no batch.
    """
    was_training = model.training
    model.eval()
    sums = None
    for batch in loader:
        _, batch_sums = reward_loss(loss_fn, model, to_device(batch, device), pad_id)
        sums = accumulate_metrics(sums, batch_sums)
    means = end_pair_validation(model, was_training, sums, loader)
    logger.info("validation accuracy %.4f", means["accuracy"])
    return means
