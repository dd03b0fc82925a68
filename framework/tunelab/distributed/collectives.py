"""Batched gathers of small sharded tensors, and a differentiable exchange of rows.

Gathering each LoRA adapter with its own ``full_tensor()`` costs one collective per tensor
(two per adapted layer): on a real model hundreds of latency-bound round trips. These are
small, so pack every rank's local rows into one buffer and gather them all at once.

:func:`all_to_all_rows` sends rows to the ranks of a group in uneven counts, its backward the
reverse exchange (expert parallelism's token dispatch, the regrouping of a fused projection's
output under tensor parallelism).
"""

import math
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def _row_sharded(tensor: torch.Tensor) -> bool:
    return (
        isinstance(tensor, DTensor)
        and tensor.device_mesh.ndim == 1
        and tuple(tensor.placements) == (Shard(0),)
    )


def gather_full_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return the full value of every tensor, gathering row-sharded DTensors in one collective.

    ``Shard(0)`` DTensors on the same 1-D mesh and of the same dtype are gathered together
    (FSDP2 splits rows like ``torch.chunk``: ``ceil(rows / world)`` per rank, the last ranks
    fewer or none). Other DTensors fall back to ``full_tensor()``; plain tensors are cloned.
    Collective: call on every rank with the same keys.

    Args:
        tensors: Small tensors keyed by name (e.g. LoRA adapter weights).

    Returns:
        Full, plain tensors keyed by the same names.
    """
    full: dict[str, torch.Tensor] = {}
    groups: dict[tuple, list[str]] = {}
    for name, tensor in tensors.items():
        if _row_sharded(tensor):
            groups.setdefault((tensor.device_mesh, tensor.dtype), []).append(name)
        elif isinstance(tensor, DTensor):
            full[name] = tensor.full_tensor()
        else:
            full[name] = tensor.detach().clone()
    for (mesh, dtype), names in groups.items():
        full.update(_gather_group({name: tensors[name] for name in names}, mesh, dtype))
    return {name: full[name] for name in tensors}


def _gather_group(tensors: dict[str, DTensor], mesh, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    group = mesh.get_group()
    world_size = dist.get_world_size(group)
    pieces, layout = [], []
    for name, tensor in tensors.items():
        rows = tensor.shape[0]
        row_numel = math.prod(tensor.shape[1:])
        rows_per_rank = math.ceil(rows / world_size)
        local = tensor.to_local().detach().reshape(-1)
        padded = local.new_zeros(rows_per_rank * row_numel)
        padded[: local.numel()] = local
        pieces.append(padded)
        layout.append((name, rows, row_numel, rows_per_rank))
    send = torch.cat(pieces)
    received = [torch.empty_like(send) for _ in range(world_size)]
    dist.all_gather(received, send, group=group)
    result = {}
    offset = 0
    for name, rows, row_numel, rows_per_rank in layout:
        size = rows_per_rank * row_numel
        parts = [buffer[offset : offset + size] for buffer in received]
        stacked = torch.cat(parts)[: rows * row_numel]
        result[name] = stacked.view(tensors[name].shape).to(dtype).clone()
        offset += size
    return result


def all_to_all_rows(
    rows: torch.Tensor,
    send_splits: list[int],
    receive_splits: list[int],
    group: dist.ProcessGroup,
    on_exchange: Callable[[torch.Tensor, list[int]], None] | None = None,
) -> torch.Tensor:
    """Send ``rows`` to the ranks of ``group`` in uneven counts; differentiable.

    Collective: every rank of ``group`` calls it with matching splits.

    Args:
        rows: ``[sum(send_splits), ...]``, the rows for rank 0 first, then rank 1's, ...
        send_splits: Rows this rank sends to each rank of ``group`` (itself included).
        receive_splits: Rows this rank receives from each rank.
        group: The ranks exchanging.
        on_exchange: Called with the rows sent and their splits at every exchange, the
            backward's reverse one included (traffic counters).

    Returns:
        ``[sum(receive_splits), ...]``, rank 0's rows first. Its gradient goes back by the
        reverse exchange.
    """
    return _AllToAllRows.apply(rows, send_splits, receive_splits, group, on_exchange)


class _AllToAllRows(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, send_splits, receive_splits, group, on_exchange):
        ctx.splits, ctx.group, ctx.on_exchange = (send_splits, receive_splits), group, on_exchange
        return _exchange(rows, send_splits, receive_splits, group, on_exchange)

    @staticmethod
    def backward(ctx, grad):
        send_splits, receive_splits = ctx.splits
        grad = _exchange(grad, receive_splits, send_splits, ctx.group, ctx.on_exchange)
        return grad, None, None, None, None


def _exchange(rows, send_splits, receive_splits, group, on_exchange) -> torch.Tensor:
    rows = rows.contiguous()
    out = rows.new_empty(sum(receive_splits), *rows.shape[1:])
    dist.all_to_all_single(out, rows, receive_splits, send_splits, group=group)
    if on_exchange is not None:
        on_exchange(rows, send_splits)
    return out
