"""Building blocks of the preference (DPO-family) step: log-probs, reference, loss, metrics.

The step itself is in ``recipes/lora_dpo_distributed.py``. Over the micro-batches of one
optimizer step, collated by ``padded_collate_dpo`` (chosen rows first, then the rejected rows of
the same pairs, in one ``[2 * pairs, seq]`` batch), it does:

1. Reference log-probs of every micro-batch, under ``torch.no_grad()`` inside
   ``reference.active()`` (:class:`ReferenceModel`), when the loss needs them
   (``loss.needs_reference``; SimPO does not).
2. One policy forward per micro-batch over chosen + rejected together
   (:func:`policy_forward`), then the per-pair losses (:func:`preference_loss`).
3. Backward of ``sum of the micro-batch's pair losses * world_size / global number of pairs``
   (:func:`global_pair_count`): the gradient of the mean over every pair of the step, whatever
   the micro-batching or world size (FSDP2 averages gradients over ranks, hence the factor).
4. Metrics (loss and the TRL-named rewards/logps/logits means) as sums reduced once over
   micro-batches and ranks (:func:`global_preference_metrics`).
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
    PreferenceLoss,
    accumulate_metrics,
    preference_metrics,
    reduce_metrics,
    sequence_logps,
)
from tunelab.losses.metrics import COUNT_KEY
from tunelab.training.loop import forward, to_device

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

    Use it as ``with torch.no_grad(), reference.active(): ...``: inside, every forward of the
    model is the reference's.

    Args:
        model: The LoRA policy model (plain or FSDP2-sharded).
        freeze_current_adapter: Snapshot the adapter's present values as the reference's
            (build it after loading the SFT adapter, before any training or resume).
        wait_for_staging: Called before the adapter is swapped in place; pass the checkpoint
            client's ``wait_for_staging``, so an async save never stages a swapped adapter.
            None when nothing can be reading the adapter meanwhile.

    Raises:
        TunelabError: If the model has no LoRA layers.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        freeze_current_adapter: bool,
        wait_for_staging: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self._wait_for_staging = wait_for_staging
        self._params = list(peft.get_adapter_params(model).values())
        self._frozen: list[torch.Tensor] | None = None
        if freeze_current_adapter:
            with torch.no_grad():
                self._frozen = [_local(param).detach().clone() for param in self._params]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make the model the reference inside the block; the policy comes back on exit.

        The model runs in eval mode (adapter dropout must not perturb a frozen reference),
        with its adapters disabled, or with the frozen SFT adapter copied into the adapter
        shards (after ``wait_for_staging``) and the policy's values copied back on exit, also
        when the block raises. Gradients and optimizer state are untouched: run only
        ``torch.no_grad()`` forwards inside, before the step's policy forwards.
        """
        was_training = self.model.training
        # Eval mode: adapter dropout must not perturb a frozen reference.
        self.model.eval()
        try:
            if self._frozen is None:
                with peft.disable_adapter(self.model):
                    yield
                return
            if self._wait_for_staging is not None:
                self._wait_for_staging()
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
        with self.active():
            return [policy_forward(self.model, b, num_chunks=num_chunks) for b in micro_batches]


def preference_loss(
    loss_fn: PreferenceLoss, policy: PolicyOutput, reference: PolicyOutput | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-pair losses of one micro-batch and the sums of its metrics.

    Args:
        loss_fn: A DPO-family loss.
        policy: The policy's :func:`policy_forward` of the micro-batch.
        reference: The reference's, or None for a reference-free loss.

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
        _, batch_sums = preference_loss(loss_fn, policy, ref)
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
