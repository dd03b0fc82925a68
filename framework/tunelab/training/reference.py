"""Sequence log-probs of the DPO policy and of its frozen reference, the same model.

A ``padded_collate_dpo`` micro-batch holds the chosen rows, then the rejected rows of the same
pairs (``[2 * pairs, seq]``). :func:`policy_forward` runs one forward over both and sums the
completion log-probs per row; ``with torch.no_grad(), reference.active():`` makes the model the
frozen reference for such forwards (:class:`ReferenceModel`). :class:`PrecomputedReference`
holds the reference log-probs of every training pair, computed once before training
(``reference_logps: precompute``), so that the steps run no reference forward.
"""

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import tunelab.peft as peft
from tunelab.distributed import all_reduce_sum
from tunelab.losses import OutputLayer, sequence_logps
from tunelab.training.loop import to_device
from tunelab.training.shared_prompts import forward_sharing_prompts


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
    num_chunks: int | None = None,
    output: OutputLayer | None = None,
) -> PolicyOutput:
    """One forward over chosen and rejected rows together, and their completion log-probs.

    A single forward instead of two halves the number of FSDP2 all-gathers and keeps the
    matmuls large; the prompt a pair's two rows share is computed once
    (:func:`~tunelab.training.shared_prompts.forward_sharing_prompts`).

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
        forward_sharing_prompts(model, batch, output),
        batch["labels"],
        num_chunks=num_chunks,
        output=output,
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
    outside autograd and before the policy forwards. :class:`PrecomputedReference` instead
    runs the reference once over the dataset before training.

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
        num_chunks: int | None = None,
        output: OutputLayer | None = None,
    ) -> list[PolicyOutput]:
        """Reference log-probs of each micro-batch (one swap for all of them).

        Args:
            micro_batches: ``padded_collate_dpo`` batches on the model's device.
            num_chunks: Chunks of the fp32 log-softmax (None: by size, see ``sequence_logps``).
            output: The model's ``output_layer``, for chunked logits.

        Returns:
            One :class:`PolicyOutput` of the reference per micro-batch.
        """
        with self.active():
            return [
                policy_forward(self.model, b, num_chunks=num_chunks, output=output)
                for b in micro_batches
            ]


def rank_share(total: int, rank: int, world_size: int) -> tuple[list[int], int]:
    """The dataset indices rank ``rank`` computes in :meth:`PrecomputedReference.compute`.

    Returns:
        ``(indices, num_owned)``: ``rank, rank + world_size, ...`` (the first ``num_owned``),
        then index 0 repeated until every rank has ``ceil(total / world_size)`` (fillers,
        computed so that all ranks run the same forwards, and dropped).
    """
    owned = list(range(rank, total, world_size))
    return owned + [0] * (-(-total // world_size) - len(owned)), len(owned)


@dataclass(frozen=True)
class ReferenceLogps:
    """The reference's summed completion log-probs of a micro-batch's pairs, ``[pairs]`` each."""

    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor


class PrecomputedReference:
    """The reference log-probs of every pair of a dataset, computed once (a ``[pairs, 2]`` table).

    For a dataset reused over epochs this replaces a reference forward per micro-batch by
    one pass over the dataset before training. Each rank computes a strided share of the
    dataset indices (``rank, rank + world_size, ...``; every rank runs the same number of
    forwards, as FSDP2 needs, the short ones repeating index 0 and discarding it), writes
    its rows into a zero table, and one all-reduce sum gives every rank the whole table
    (adding zeros is exact). Row ``i`` is pair ``i`` of the dataset, whatever the world size
    and the sampler's order, so a resumed run recomputes the same table instead of saving
    it. Batches find their rows through ``pair_index`` (``IndexedPairs``).

    Build it with :meth:`compute`; :meth:`logps` looks up a micro-batch's rows.

    Args:
        table: ``[pairs, 2]`` float: chosen, rejected log-probs of each dataset pair.
    """

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    @classmethod
    @torch.no_grad()
    def compute(
        cls,
        reference: ReferenceModel,
        loader: DataLoader,
        device: torch.device,
        *,
        num_chunks: int | None = None,
        output: OutputLayer | None = None,
        unit: str = "pairs",
    ) -> "PrecomputedReference":
        """Run the reference over every pair of ``loader.dataset`` (a collective: all ranks).

        Args:
            reference: The frozen reference.
            loader: The training loader: its dataset, ``collate_fn`` and ``batch_size`` are
                used (not its sampler: the whole dataset, in index order, is split here).
            device: The model's device.
            num_chunks: Chunks of the fp32 log-softmax (None: by size, see ``sequence_logps``).
            output: The model's ``output_layer``, for chunked logits.
            unit: What the log line calls a dataset item (KTO: ``rows``).

        Returns:
            The table, the same on every rank, on ``device``. Rank 0 says how long it took.
        """
        began = time.perf_counter()
        dataset, batch_size = loader.dataset, loader.batch_size or 1
        total = len(dataset)
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        share, num_owned = rank_share(total, rank, world_size)
        table = torch.zeros(total, 2, dtype=torch.float32, device=device)
        with reference.active():
            for start in range(0, len(share), batch_size):
                indices = share[start : start + batch_size]
                batch = to_device(loader.collate_fn([dataset[i] for i in indices]), device)
                ref = policy_forward(reference.model, batch, num_chunks=num_chunks, output=output)
                values = torch.stack([ref.chosen_logps, ref.rejected_logps], dim=1).float()
                kept = min(len(indices), max(num_owned - start, 0))
                table[torch.tensor(indices[:kept], device=device)] = values[:kept]
        table = all_reduce_sum(table)
        if rank == 0:
            seconds = time.perf_counter() - began
            print(
                f"reference log-probs of {total} {unit} precomputed in {seconds:.1f} s", flush=True
            )
        return cls(table)

    def logps(self, batch: dict[str, torch.Tensor]) -> ReferenceLogps:
        """The reference log-probs of a ``padded_collate_dpo`` batch's pairs, by ``pair_index``."""
        rows = self.table[batch["pair_index"]]
        return ReferenceLogps(chosen_logps=rows[:, 0], rejected_logps=rows[:, 1])
