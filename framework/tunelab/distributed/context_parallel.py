"""Context parallelism: the ranks of a group split every sequence, attention gathers K/V.

With ``context_parallel_size: N`` the N ranks of one context-parallel (cp) group train on the
same samples, each holding a slice of every sequence: activations per rank shrink N-fold.
The row is padded to a multiple of ``2N`` and cut into ``2N`` chunks; rank ``i`` takes chunks
``i`` and ``2N - 1 - i``: under a causal mask the late chunks see many keys and the early ones
few, so pairing them balances the attention work. This is the all-gather form of context
parallelism that Llama 3 was trained with (The Llama 3 Herd of Models, 2024,
https://arxiv.org/abs/2407.21783, section 3.3.2: 2N chunks, keys and values all-gathered, not
passed around a ring), with the same load-balancing split as Megatron-LM's and torchtitan's.

Attention all-gathers keys and values over the group (after rotary, which each rank applies
with its tokens' global positions) and puts them back in row order; each rank's queries then
attend to the whole row under the mask of their global positions (``AttentionMask`` with
``query_positions``). The all-gather's backward reduce-scatters (sums) the K/V gradients back
to the ranks that own those tokens, so gradients are exact. Everything outside attention is
per token and needs no communication.

The loss needs one more thing: position ``t`` is scored against the label of ``t + 1``, which
may live on another rank. :meth:`ContextParallel.shard` therefore shifts the labels before
splitting: the local ``labels`` carry one leading ignored column, so ``labels[:, 1:]`` is each
local position's own target and a loss that shifts (``logits[:, :-1]`` against
``labels[:, 1:]``) sees one extra, unscored position appended to the logits (``batch_loss``
pads it). Each target is then counted on exactly one rank, and the recipes' token count and
loss sums over all ranks are the unsplit run's.

Rank layout: cp is the innermost mesh dimension (ranks ``k*N .. k*N + N - 1`` form a group,
so a group sits on one node, where the K/V all-gathers are fast). FSDP2 shards parameters over
the data-parallel shard ranks and the cp ranks together (torchtitan's ``dp_shard_cp``): cp
ranks compute gradients of the same parameters from different tokens, so FSDP's reduction over
every rank of the shard group sums them, and the recipes' ``world_size / num_tokens`` scaling
stays exact.
"""

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from tunelab.distributed.process_group import collective_timeout
from tunelab.errors import ConfigError

if TYPE_CHECKING:
    from tunelab.distributed.mesh import DeviceMeshes

_ROW_KEYS = ("tokens", "token_mask", "input_pos")


class _GatherSequence(torch.autograd.Function):
    """All-gather zig-zag slices into whole rows; the backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, context: "ContextParallel", dim: int) -> torch.Tensor:  # noqa: ANN001
        ctx.context, ctx.dim = context, dim
        local = local.contiguous()
        gathered = [torch.empty_like(local) for _ in range(context.size)]
        dist.all_gather(gathered, local, group=context.group)
        halves = [piece.chunk(2, dim=dim) for piece in gathered]
        size = context.size
        # Rank i holds chunks i and 2N-1-i: chunk j < N is rank j's first half, chunk
        # N + k is rank N-1-k's second half.
        ordered = [halves[j][0] for j in range(size)] + [
            halves[size - 1 - k][1] for k in range(size)
        ]
        return torch.cat(ordered, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        context, dim = ctx.context, ctx.dim
        size = context.size
        chunks = grad.chunk(2 * size, dim=dim)
        # Every rank's queries used every key: sum the gradients of each rank's own chunks.
        inputs = [torch.cat([chunks[r], chunks[2 * size - 1 - r]], dim=dim) for r in range(size)]
        inputs = [piece.contiguous() for piece in inputs]
        local = torch.empty_like(inputs[0])
        dist.reduce_scatter(local, inputs, op=dist.ReduceOp.SUM, group=context.group)
        return local, None, None


class ContextParallel:
    """This rank's place in its context-parallel group, and the operations cp needs.

    Size 1 is the identity: :meth:`shard` returns the batch unchanged and the model runs as
    without cp.

    Args:
        size: Ranks per group (``context_parallel_size``).
        group: The group of this rank (None for size 1, or to only split batches).
        rank: This rank in the group (None: read from ``group``).
        split_within: Ranks that split each rank's slice once more, in equal consecutive
            parts (tensor parallelism's sequence-parallel regions,
            ``tunelab.distributed.tensor_parallel``): rows are padded so that the slice
            divides by it.
    """

    def __init__(
        self,
        size: int = 1,
        group: ProcessGroup | None = None,
        rank: int | None = None,
        split_within: int = 1,
    ) -> None:
        if rank is None:
            rank = dist.get_rank(group) if size > 1 else 0
        assert 0 <= rank < size, (rank, size)
        self.size = size
        self.group = group
        self.rank = rank
        self.split_within = split_within

    @property
    def enabled(self) -> bool:
        """Whether sequences are split (more than one rank per group)."""
        return self.size > 1

    def padded_length(self, seq_len: int) -> int:
        """``seq_len`` rounded up to a multiple of ``2 * size * split_within``.

        ``2 * size``: the zig-zag chunks; ``split_within``: each rank's slice then divides
        among the tensor-parallel ranks that split it again.
        """
        multiple = 2 * self.size * self.split_within
        return math.ceil(seq_len / multiple) * multiple

    def query_positions(self, seq_len: int, device: torch.device | str) -> torch.Tensor:
        """Long ``[seq_len / size]``: the row positions this rank holds, in its local order.

        Args:
            seq_len: The padded row length (a multiple of ``2 * size``).
            device: Where to build the index.
        """
        if seq_len % (2 * self.size):
            raise ValueError(f"row length {seq_len} is not a multiple of 2 x {self.size}")
        chunk = seq_len // (2 * self.size)
        first = torch.arange(self.rank * chunk, (self.rank + 1) * chunk, device=device)
        last_chunk = 2 * self.size - 1 - self.rank
        second = torch.arange(last_chunk * chunk, (last_chunk + 1) * chunk, device=device)
        return torch.cat([first, second])

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """Whole rows, in row order, from every rank's zig-zag slice along ``dim``.

        Autograd-aware: the backward sums the gradient over the group and returns each rank
        the part of its own positions. Collective over the group.
        """
        return _GatherSequence.apply(local, self, dim)

    def gather_key_values(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, kv_heads, local_seq, head_dim]`` of the whole row.

        One all-gather for both (concatenated over heads).
        """
        heads = keys.shape[1]
        whole = self.gather(torch.cat([keys, values], dim=1), dim=2)
        return whole[:, :heads], whole[:, heads:]

    def sum_over_group(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the group's ranks (collective; a copy, autograd-free)."""
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.group)
        return value

    def max_over_group(self, value: torch.Tensor) -> torch.Tensor:
        """The largest ``value`` of the group's ranks (collective; a copy, autograd-free)."""
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return value

    def shard(self, batch: dict[str, torch.Tensor], ignore_index: int = -100) -> dict:
        """This rank's slice of a collated SFT batch (every rank of the group has the same).

        Rows are padded to :meth:`padded_length` (padding: token 0, no target, a document of
        its own, position 0, so that no padding raises the rows' largest position, from which
        LongRoPE picks its factors), then split zig-zag. ``tokens``,
        ``token_mask`` and ``input_pos`` (rotary positions: the global ones, ``0..seq-1`` for
        unpacked rows) become ``[batch, seq / size]``; ``labels`` ``[batch, seq / size + 1]``,
        shifted (module docstring); ``document_ids`` stays whole (the mask needs every key's).

        Args:
            batch: ``tokens``, ``labels`` and optionally ``token_mask``, ``input_pos``,
                ``document_ids``, all ``[batch, seq]``.
            ignore_index: The label of positions without a target.

        Returns:
            The local batch (the input itself when cp is off).

        Raises:
            ValueError: A key this split does not know (it cannot guess how to cut it).
        """
        if not self.enabled:
            return batch
        unknown = set(batch) - {*_ROW_KEYS, "labels", "document_ids"}
        if unknown:
            raise ValueError(f"context parallelism cannot split batch keys {sorted(unknown)}")
        tokens = batch["tokens"]
        rows, seq_len = tokens.shape
        padded = self.padded_length(seq_len)
        pad = padded - seq_len
        if "input_pos" in batch:
            input_pos = batch["input_pos"]
        else:
            input_pos = torch.arange(seq_len, device=tokens.device).expand(rows, seq_len)
        full = {
            "tokens": F.pad(tokens, (0, pad), value=0),
            "input_pos": F.pad(input_pos, (0, pad), value=0),
        }
        if "token_mask" in batch:
            full["token_mask"] = F.pad(batch["token_mask"], (0, pad), value=False)
        # The target of position t is the label of t + 1 (the last position has none).
        targets = F.pad(batch["labels"][:, 1:], (0, 1 + pad), value=ignore_index)
        positions = self.query_positions(padded, tokens.device)
        local = {key: value[:, positions] for key, value in full.items()}
        first = targets.new_full((rows, 1), ignore_index)
        local["labels"] = torch.cat([first, targets[:, positions]], dim=1)
        if "document_ids" in batch:
            document_ids = batch["document_ids"]
            own = document_ids.max(dim=1, keepdim=True).values + 1
            local["document_ids"] = torch.cat([document_ids, own.expand(rows, pad)], dim=1)
        return local


def build_context_parallel(
    context_parallel_size: int, meshes: "DeviceMeshes | None" = None
) -> ContextParallel:
    """The cp group of this rank (collective).

    Without tensor parallelism the N ranks ``k * N .. k * N + N - 1`` form a group. With it
    (``meshes.context``, the world mesh's ``"cp"`` dimension, next to the innermost ``"tp"``)
    a group is the ranks of one data-parallel shard that hold the same tensor-parallel index,
    ``T`` apart for ``T`` tp ranks; each rank's slice of a row is split again over its tp
    group (sequence parallelism), so rows are padded to a multiple of ``2 * N * T``.

    Args:
        context_parallel_size: ``parallelism.context_parallel_size``, N; must divide the world
            size (``data_parallel_mesh`` checks the whole mesh).
        meshes: The run's meshes (``build_device_meshes``); None or without ``context``: the
            consecutive groups above.

    Raises:
        ConfigError: N above 1 without a process group, or not dividing the world.
    """
    size = context_parallel_size
    if size == 1:
        return ContextParallel()
    if meshes is not None and meshes.context is not None:
        tensor = 1 if meshes.tensor is None else meshes.tensor.size()
        return ContextParallel(size, meshes.context.get_group(), split_within=tensor)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size % size:
        raise ConfigError(
            f"parallelism.context_parallel_size: {size} does not divide the {world_size} "
            "processes of this run"
        )
    group, _ = dist.new_subgroups(group_size=size, timeout=collective_timeout())
    return ContextParallel(size, group)
