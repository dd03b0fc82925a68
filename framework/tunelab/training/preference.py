"""Building blocks of the preference (DPO-family) step: loss, pair count, metrics, validation.

The step itself is in ``recipes/lora_dpo_distributed.py``. Over the micro-batches of one
optimizer step it takes the reference log-probs (``tunelab.training.reference``), one policy
forward per micro-batch and its per-pair losses (:func:`preference_loss`), and back-propagates
``sum of the micro-batch's pair losses * world_size / global number of pairs``
(:func:`global_pair_count`): the gradient of the mean over every pair of the step, whatever the
micro-batching or world size (FSDP2 averages gradients over ranks, hence the factor). Metrics
(loss and the TRL-named rewards/logps/logits means) are sums reduced once over micro-batches and
ranks (:func:`global_preference_metrics`).
"""

import logging

import torch
from torch import nn
from torch.utils.data import DataLoader

from tunelab.data import IGNORE_INDEX
from tunelab.distributed import all_reduce_sum
from tunelab.errors import ConfigError, DataError
from tunelab.losses import (
    OutputLayer,
    PreferenceLoss,
    accumulate_metrics,
    preference_metrics,
    reduce_metrics,
)
from tunelab.losses.metrics import COUNT_KEY
from tunelab.training.loop import to_device
from tunelab.training.reference import (
    PolicyOutput,
    PrecomputedReference,
    ReferenceLogps,
    ReferenceModel,
    num_pairs,
    policy_forward,
    reshard_all,
)

logger = logging.getLogger(__name__)

_TOKENS_KEY = "num_tokens"


def check_preference_loss(loss_fn: object, recipe: str) -> PreferenceLoss:
    """``loss_fn`` if it is a DPO-family loss, else one clear error naming what it is.

    Raises:
        ConfigError: If the configured ``loss`` is not a ``PreferenceLoss``.
    """
    if not isinstance(loss_fn, PreferenceLoss):
        raise ConfigError(
            f"loss: {recipe} needs a preference loss (tunelab.losses.DPOLoss, IPOLoss, "
            f"HingeLoss, SimPOLoss, ORPOLoss), got {type(loss_fn).__name__}; KTOLoss trains "
            "on unpaired rows with kto_distributed"
        )
    return loss_fn


def step_references(
    model: nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    loss_fn: PreferenceLoss,
    reference: ReferenceModel,
    precomputed: PrecomputedReference | None,
    *,
    output: OutputLayer | None = None,
) -> list[PolicyOutput | ReferenceLogps | None]:
    """The reference log-probs of one optimizer step's micro-batches, before any policy forward.

    Looked up in the precomputed table when there is one; else one reference forward per
    micro-batch, all under one swap (``reference.active()``, no gradient); None each for a
    reference-free loss (SimPO).
    """
    if precomputed is not None:
        return [precomputed.logps(batch) for batch in micro_batches]
    if not loss_fn.needs_reference:
        return [None] * len(micro_batches)
    with torch.no_grad(), reference.active():
        return [policy_forward(model, batch, output=output) for batch in micro_batches]


def preference_loss(
    loss_fn: PreferenceLoss,
    policy: PolicyOutput,
    reference: PolicyOutput | ReferenceLogps | None,
    chosen_tokens_per_pair: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-pair losses of one micro-batch and the sums of its metrics.

    Args:
        loss_fn: A DPO-family loss.
        policy: The policy's :func:`policy_forward` of the micro-batch.
        reference: The reference's (a forward's, or a :class:`PrecomputedReference` lookup),
            or None for a reference-free loss.
        chosen_tokens_per_pair: The step's :func:`global_chosen_tokens_per_pair`, for a loss
            with ``adds_chosen_nll`` (ORPO); None: the micro-batch's own.

    Returns:
        ``(losses, sums)``: the ``[pairs]`` losses (with grad) and the detached sums of the
        loss and of the TRL-named metrics over the pairs, with the pair count and the number of
        completion tokens, for :func:`tunelab.losses.accumulate_metrics` and
        :func:`global_preference_metrics`.
    """
    losses, chosen_rewards, rejected_rewards = loss_fn(
        policy.chosen_logps,
        policy.rejected_logps,
        None if reference is None else reference.chosen_logps,
        None if reference is None else reference.rejected_logps,
        policy.chosen_lengths,
        policy.rejected_lengths,
        chosen_tokens_per_pair,
    )
    sums = preference_metrics(
        chosen_rewards,
        rejected_rewards,
        policy.chosen_logps,
        policy.rejected_logps,
        policy.chosen_mean_logits,
        policy.rejected_mean_logits,
    )
    sums["loss"] = losses.detach().double().sum()
    sums[_TOKENS_KEY] = (policy.chosen_lengths.sum() + policy.rejected_lengths.sum()).double()
    return losses, sums


def global_pair_count(micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Preference pairs of one optimizer step, summed over micro-batches and ranks.

    The loss of a step is ``sum of per-pair losses / this count``, so every pair weighs the
    same whatever the micro-batching or the world size.

    Returns:
        A 0-dim float tensor on the batches' device, at least 1.
    """
    local_pairs = sum(num_pairs(batch) for batch in micro_batches)
    device = micro_batches[0]["tokens"].device
    return all_reduce_sum(torch.tensor(float(local_pairs), device=device)).clamp_min(1)


def global_chosen_tokens_per_pair(
    micro_batches: list[dict[str, torch.Tensor]], num_pairs: torch.Tensor
) -> torch.Tensor:
    """Chosen completion tokens of one optimizer step per pair, over micro-batches and ranks.

    ORPO's NLL is a mean over these tokens (TRL's, per micro-batch): the per-pair losses
    divide their chosen NLL by this, so the step's loss is the token mean whatever the
    micro-batching or the world size. Counted from the labels, before any forward.

    Args:
        micro_batches: The step's ``padded_collate_dpo`` batches (chosen rows first).
        num_pairs: The step's :func:`global_pair_count`.

    Returns:
        A 0-dim float tensor on the batches' device.
    """
    # Chosen rows are each batch's first half; labels align with tokens (shifted by one here).
    local = sum(
        (batch["labels"][: batch["labels"].shape[0] // 2, 1:] != IGNORE_INDEX).sum()
        for batch in micro_batches
    )
    return all_reduce_sum(torch.as_tensor(local, dtype=torch.float64).reshape(())) / num_pairs


def _global_means(sums: dict[str, torch.Tensor]) -> tuple[dict[str, float], float]:
    # One collective for every metric; the token count rides along as a mean per pair.
    means = reduce_metrics(sums, sums[COUNT_KEY])
    return means, means.pop(_TOKENS_KEY)


def global_preference_metrics(
    sums: dict[str, torch.Tensor], num_pairs: torch.Tensor
) -> tuple[dict[str, float], float]:
    """Means of a step's metric sums over all its pairs (one all-reduce), and its tokens.

    Args:
        sums: This rank's :func:`preference_loss` sums, accumulated over the micro-batches.
        num_pairs: The step's :func:`global_pair_count`.

    Returns:
        ``(metrics, num_tokens)``: ``loss``, ``rewards/*``, ``logps/*``, ``logits/*`` (the same
        on every rank) and the global number of completion tokens (chosen + rejected).
    """
    means, tokens_per_pair = _global_means(sums)
    return means, tokens_per_pair * num_pairs.item()


@torch.no_grad()
def evaluate_preference(
    model: nn.Module,
    loader: DataLoader,
    loss_fn: PreferenceLoss,
    reference: ReferenceModel,
    device: torch.device,
    *,
    output: OutputLayer | None = None,
) -> dict[str, float]:
    """Loss and preference metrics averaged over every pair of a validation loader.

    Args:
        model: The LoRA policy model.
        loader: Validation batches from ``padded_collate_dpo``.
        loss_fn: The training loss.
        reference: The frozen reference.
        device: The model's device.
        output: The model's ``output_layer``, for chunked logits (None: the log-softmax is
            chunked by size, see ``sequence_logps``).

    Returns:
        Global means over all ranks' pairs, keyed like the training metrics.

    Raises:
        DataError: If the loader gives no batch.
    """
    was_training = model.training
    model.eval()
    sums = None
    for batch in loader:
        batch = to_device(batch, device)
        ref = reference.logps([batch], output=output)[0] if loss_fn.needs_reference else None
        policy = policy_forward(model, batch, output=output)
        _, batch_sums = preference_loss(loss_fn, policy, ref)
        sums = accumulate_metrics(sums, batch_sums)
    means = end_pair_validation(model, was_training, sums, loader)
    logger.info("validation loss %.4f", means["loss"])
    return means


def end_pair_validation(
    model: nn.Module,
    was_training: bool,
    sums: dict[str, torch.Tensor] | None,
    loader: DataLoader,
) -> dict[str, float]:
    """End a validation pass over pairs: reshard, restore the mode, and the global means.

    Raises:
        DataError: If the loader gave no batch (``sums`` is None).
    """
    reshard_all(model)
    model.train(was_training)
    if sums is None:
        # The sampler gives every rank the same number of batches, so all ranks get here.
        raise DataError(
            f"val_dataset has fewer than schedule.batch_size={loader.batch_size} pairs per "
            "process; lower schedule.batch_size or add validation pairs"
        )
    return _global_means(sums)[0]
