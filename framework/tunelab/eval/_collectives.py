"""The collectives lm-eval's evaluator and :class:`~tunelab.eval.TunelabLM` need across ranks.

lm-eval splits a task's documents over ranks itself (``lm.rank``, ``lm.world_size``) and
gathers the per-document results on rank 0 (``lm.gather_object``). What it does not know is
that a model sharded with FSDP2 all-gathers its parameters in every forward, so every rank
must run the same number of forwards: the LM agrees on the number of batches first and a rank
with fewer requests runs placeholder batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor``, concatenated along dim 0 (0-dim tensors stacked), on all ranks."""
    if world()[1] == 1:
        return tensor
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor.contiguous())
    return torch.stack(pieces) if tensor.dim() == 0 else torch.cat(pieces)


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on ``dst``; None on the other ranks."""
    if world()[1] == 1:
        return [obj]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, object_gather_list=gathered, dst=dst)
    return gathered


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order, on every rank."""
    if world()[1] == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def max_over_ranks(value: int) -> int:
    """The largest ``value`` any rank holds (one all-reduce; ``value`` itself on one process)."""
    if world()[1] == 1:
        return value
    # A CPU tensor: the process group's gloo side takes it on CPU and CUDA machines alike.
    tensor = torch.tensor(value, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor)


def barrier() -> None:
    """Wait for every rank (nothing on one process)."""
    if world()[1] > 1:
        dist.barrier()
