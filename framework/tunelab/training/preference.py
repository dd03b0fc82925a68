"""The preference (DPO-family) training step: policy and reference log-probs, loss, metrics.

One optimizer step over micro-batches collated by ``padded_collate_dpo`` (chosen rows first,
then the rejected rows of the same pairs, in one ``[2 * pairs, seq]`` batch):

1. Reference log-probs of every micro-batch, under ``torch.no_grad()`` in eval mode, when the
   loss needs them (``loss.needs_reference``; SimPO does not). See :class:`ReferenceModel`.
2. One policy forward per micro-batch over chosen + rejected together, then the loss.
3. The gradient is that of ``sum of per-pair losses over ranks and micro-batches / global
   number of pairs``: every pair weighs the same whatever the micro-batching or world size.
4. Metrics (loss and the TRL-named rewards/logps/logits means) are sums reduced once over
   micro-batches and ranks (:func:`tunelab.losses.reduce_metrics`).
"""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import tunelab.peft as peft
from tunelab.distributed import all_reduce_sum
from tunelab.errors import DataError
from tunelab.losses import (
    COUNT_KEY,
    PreferenceLoss,
    accumulate_metrics,
    preference_metrics,
    reduce_metrics,
    sequence_logps,
)
from tunelab.training.loop import forward, to_device

__all__ = [
    "PolicyOutput",
    "ReferenceModel",
    "evaluate_preference",
    "num_pairs",
    "policy_forward",
    "preference_backward",
]

_TOKENS_KEY = "num_tokens"


@dataclass(frozen=True)
class PolicyOutput:
    """Per-pair results of one forward over a concatenated chosen + rejected batch.

    Every field is ``[pairs]``; the log-probs are summed over the completion tokens.
    """

    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_lengths: torch.Tensor
    rejected_lengths: torch.Tensor
    chosen_mean_logits: torch.Tensor
    rejected_mean_logits: torch.Tensor


def num_pairs(batch: dict[str, torch.Tensor]) -> int:
    """Number of preference pairs in a ``padded_collate_dpo`` batch (half its rows)."""
    rows = batch["tokens"].shape[0]
    assert rows % 2 == 0, "a preference batch holds chosen and rejected rows in equal number"
    return rows // 2


def policy_forward(
    model: nn.Module, batch: dict[str, torch.Tensor], *, num_chunks: int = 8
) -> PolicyOutput:
    """One forward over chosen and rejected rows together, and their completion log-probs.

    A single forward instead of two halves the number of FSDP2 all-gathers and keeps the
    matmuls large.

    Args:
        model: The model (with or without grad, as the caller chooses).
        batch: ``tokens`` and ``labels`` ``[2 * pairs, seq]``, chosen rows first.
        num_chunks: Sequence chunks of the fp32 log-softmax (see ``sequence_logps``).

    Returns:
        The per-pair summed log-probs, completion lengths and mean completion logits.
    """
    pairs = num_pairs(batch)
    logits = forward(model, batch)
    logps, lengths, mean_logits = sequence_logps(logits, batch["labels"], num_chunks=num_chunks)
    return PolicyOutput(
        chosen_logps=logps[:pairs],
        rejected_logps=logps[pairs:],
        chosen_lengths=lengths[:pairs],
        rejected_lengths=lengths[pairs:],
        chosen_mean_logits=mean_logits[:pairs],
        rejected_mean_logits=mean_logits[pairs:],
    )


def _reshard_all(model: nn.Module) -> None:
    # After a no_grad forward FSDP2 may keep gathered parameters (always the root's, every
    # group's with reshard_after_forward=False); in-place edits of the shards would then not
    # reach the next forward.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


class ReferenceModel:
    """The frozen reference of DPO, run as the policy model itself: no second model in memory.

    Without a starting adapter the reference is the base model: the forward runs inside
    ``peft.disable_adapter``, which only flips a flag on the LoRA layers, so it works
    unchanged under FSDP2.

    When training starts from an SFT adapter (``adapter_dir``) the reference must be base +
    that adapter, frozen, while the policy's copy of it trains. This class keeps a copy of
    the adapter's *local shards* as loaded (the adapter is small: rank r times the layer
    widths, split over the ranks like every parameter), and for the reference forwards
    copies them into the live shards, runs the forwards, and copies the policy's values
    back. The swap is exact (bit-identical copies of the same dtype), costs two adapter
    copies of memory, needs no communication (every rank swaps its own shards; FSDP2 gathers
    from them in the next forward), and is done once per optimizer step for all its
    micro-batches. Gradients and optimizer state are untouched, since the swap happens
    outside autograd and before the policy forwards. Precomputing reference log-probs over
    the dataset would be exact too, but costs a full extra pass before training and ties
    the cache to the data order and world size.

    Args:
        model: The LoRA policy model (plain or FSDP2-sharded).
        freeze_current_adapter: Snapshot the adapter's present values as the reference's
            (call right after loading the SFT adapter, before any training or resume).

    Raises:
        TunelabError: If the model has no LoRA layers.
    """

    def __init__(self, model: nn.Module, *, freeze_current_adapter: bool) -> None:
        self.model = model
        self.before_swap: Callable[[], None] = lambda: None
        """Called before adapter weights are swapped in place (the recipe passes the
        checkpoint client's ``wait_for_staging``, so an async save never stages a swapped
        adapter)."""
        self._params = list(peft.get_adapter_params(model).values())
        self._frozen: list[torch.Tensor] | None = None
        if freeze_current_adapter:
            with torch.no_grad():
                self._frozen = [_local(param).detach().clone() for param in self._params]

    @contextlib.contextmanager
    def _as_reference(self) -> Iterator[None]:
        was_training = self.model.training
        # Eval mode: adapter dropout must not perturb a frozen reference.
        self.model.eval()
        try:
            if self._frozen is None:
                with peft.disable_adapter(self.model):
                    yield
                return
            self.before_swap()
            _reshard_all(self.model)
            live = [_local(param).detach().clone() for param in self._params]
            try:
                for param, frozen in zip(self._params, self._frozen, strict=True):
                    _local(param).detach().copy_(frozen)
                yield
            finally:
                _reshard_all(self.model)
                for param, value in zip(self._params, live, strict=True):
                    _local(param).detach().copy_(value)
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def logps(
        self, micro_batches: list[dict[str, torch.Tensor]], *, num_chunks: int = 8
    ) -> list[PolicyOutput]:
        """Reference log-probs of each micro-batch (one swap for all of them).

        Args:
            micro_batches: ``padded_collate_dpo`` batches on the model's device.
            num_chunks: Sequence chunks of the fp32 log-softmax.

        Returns:
            One :class:`PolicyOutput` of the reference per micro-batch.
        """
        with self._as_reference():
            return [policy_forward(self.model, b, num_chunks=num_chunks) for b in micro_batches]


def _pair_loss(
    loss_fn: PreferenceLoss, policy: PolicyOutput, reference: PolicyOutput | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    losses, chosen_rewards, rejected_rewards = loss_fn(
        policy.chosen_logps,
        policy.rejected_logps,
        None if reference is None else reference.chosen_logps,
        None if reference is None else reference.rejected_logps,
        policy.chosen_lengths,
        policy.rejected_lengths,
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
    return losses.sum(), sums


def _global_means(sums: dict[str, torch.Tensor]) -> tuple[dict[str, float], float]:
    # One collective for every metric; the token count rides along as a mean per pair.
    means = reduce_metrics(sums, sums[COUNT_KEY])
    return means, means.pop(_TOKENS_KEY)


def preference_backward(
    model: nn.Module,
    loss_fn: PreferenceLoss,
    reference: ReferenceModel,
    micro_batches: list[dict[str, torch.Tensor]],
    world_size: int,
    *,
    num_chunks: int = 8,
) -> tuple[dict[str, float], float]:
    """Forward and backward over one optimizer step's micro-batches of preference pairs.

    The gradient is that of ``sum of per-pair losses over all ranks and micro-batches /
    number of pairs over all ranks and micro-batches``. FSDP2 averages gradients over ranks,
    so each micro-batch back-propagates ``sum of its losses * world_size / global pairs``.

    Args:
        model: The LoRA policy model, in train mode.
        loss_fn: A DPO-family loss; its ``needs_reference`` decides the reference forwards.
        reference: The frozen reference (see :class:`ReferenceModel`).
        micro_batches: ``padded_collate_dpo`` batches on the model's device.
        world_size: Number of data-parallel ranks.
        num_chunks: Sequence chunks of the fp32 log-softmax.

    Returns:
        ``(metrics, num_tokens)``: the global means over the step's pairs (``loss``,
        ``rewards/*``, ``logps/*``, ``logits/*``; the same on every rank) and the global
        number of completion tokens (chosen + rejected).
    """
    references: list[PolicyOutput | None] = [None] * len(micro_batches)
    if loss_fn.needs_reference:
        references = reference.logps(micro_batches, num_chunks=num_chunks)
    local_pairs = sum(num_pairs(batch) for batch in micro_batches)
    device = micro_batches[0]["tokens"].device
    global_pairs = all_reduce_sum(torch.tensor(float(local_pairs), device=device)).clamp_min(1)
    sums = None
    for batch, ref in zip(micro_batches, references, strict=True):
        policy = policy_forward(model, batch, num_chunks=num_chunks)
        loss_sum, batch_sums = _pair_loss(loss_fn, policy, ref)
        (loss_sum * world_size / global_pairs).backward()
        sums = accumulate_metrics(sums, batch_sums)
    means, tokens_per_pair = _global_means(sums)
    return means, tokens_per_pair * global_pairs.item()


@torch.no_grad()
def evaluate_preference(
    model: nn.Module,
    loader: DataLoader,
    loss_fn: PreferenceLoss,
    reference: ReferenceModel,
    device: torch.device,
    *,
    num_chunks: int = 8,
) -> dict[str, float]:
    """Loss and preference metrics averaged over every pair of a validation loader.

    Args:
        model: The LoRA policy model.
        loader: Validation batches from ``padded_collate_dpo``.
        loss_fn: The training loss.
        reference: The frozen reference.
        device: The model's device.
        num_chunks: Sequence chunks of the fp32 log-softmax.

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
        ref = (
            reference.logps([batch], num_chunks=num_chunks)[0] if loss_fn.needs_reference else None
        )
        policy = policy_forward(model, batch, num_chunks=num_chunks)
        _, batch_sums = _pair_loss(loss_fn, policy, ref)
        sums = accumulate_metrics(sums, batch_sums)
    _reshard_all(model)
    model.train(was_training)
    if sums is None:
        # The sampler gives every rank the same number of batches, so all ranks get here.
        raise DataError(
            f"val_dataset has fewer than batch_size={loader.batch_size} pairs per process; "
            "lower batch_size or add validation pairs"
        )
    return _global_means(sums)[0]
