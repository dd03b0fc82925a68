"""Sequence log-probs of the DPO policy and of its frozen reference, the same model.

A ``padded_collate_dpo`` micro-batch holds the chosen rows, then the rejected rows of the same
pairs (``[2 * pairs, seq]``). :func:`policy_forward` runs one forward over both and sums the
completion log-probs per row; ``with torch.no_grad(), reference.active():`` makes the model the
frozen reference for such forwards (:class:`ReferenceModel`).
"""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import tunelab.peft as peft
from tunelab.losses import OutputLayer, sequence_logps
from tunelab.training.loop import forward


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
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    num_chunks: int = 8,
    output: OutputLayer | None = None,
) -> PolicyOutput:
    """One forward over chosen and rejected rows together, and their completion log-probs.

    A single forward instead of two halves the number of FSDP2 all-gathers and keeps the
    matmuls large.

    Args:
        model: The model (with or without grad, as the caller chooses).
        batch: ``tokens`` and ``labels`` ``[2 * pairs, seq]``, chosen rows first.
        num_chunks: Sequence chunks of the fp32 log-softmax (see ``sequence_logps``).
        output: The model's ``output_layer``: the logits are then computed chunk by chunk and
            never exist whole.

    Returns:
        The per-pair summed log-probs, completion lengths and mean completion logits.
    """
    pairs = num_pairs(batch)
    logps, lengths, mean_logits = sequence_logps(
        forward(model, batch, output), batch["labels"], num_chunks=num_chunks, output=output
    )
    return PolicyOutput(
        chosen_logps=logps[:pairs],
        rejected_logps=logps[pairs:],
        chosen_lengths=lengths[:pairs],
        rejected_lengths=lengths[pairs:],
        chosen_mean_logits=mean_logits[:pairs],
        rejected_mean_logits=mean_logits[pairs:],
    )


def reshard_all(model: nn.Module) -> None:
    """Reshard the FSDP2 modules of ``model`` that hold trainable parameters (plain: no-op).

    After a no_grad forward FSDP2 may keep gathered parameters (always the root's, every
    group's with ``reshard_after_forward=False``); in-place edits of the shards would then not
    reach the next forward.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule) and _manages_trainable(module):
            module.reshard()


def _manages_trainable(module: FSDPModule) -> bool:
    # Whether the FSDP2 group of ``module`` holds trainable parameters. The groups of a frozen
    # base kept gathered (``frozen_base: replicate``) hold none: no in-place edit reaches
    # them, and resharding them would only cost a gather at the next forward.
    nested = {
        id(param)
        for sub in module.modules()
        if sub is not module and isinstance(sub, FSDPModule)
        for param in sub.parameters()
    }
    return any(p.requires_grad and id(p) not in nested for p in module.parameters())


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
            reshard_all(self.model)
            live = [_local(param).detach().clone() for param in self._params]
            try:
                for param, frozen in zip(self._params, self._frozen, strict=True):
                    _local(param).detach().copy_(frozen)
                yield
            finally:
                reshard_all(self.model)
                for param, value in zip(self._params, live, strict=True):
                    _local(param).detach().copy_(value)
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def logps(
        self,
        micro_batches: list[dict[str, torch.Tensor]],
        *,
        num_chunks: int = 8,
        output: OutputLayer | None = None,
    ) -> list[PolicyOutput]:
        """Reference log-probs of each micro-batch (one swap for all of them).

        Args:
            micro_batches: ``padded_collate_dpo`` batches on the model's device.
            num_chunks: Sequence chunks of the fp32 log-softmax.
            output: The model's ``output_layer``, for chunked logits.

        Returns:
            One :class:`PolicyOutput` of the reference per micro-batch.
        """
        with self.active():
            return [
                policy_forward(self.model, b, num_chunks=num_chunks, output=output)
                for b in micro_batches
            ]
