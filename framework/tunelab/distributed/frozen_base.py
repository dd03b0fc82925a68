"""Where a LoRA run keeps its frozen base weights: replicated (gathered once) or sharded.

Under FSDP2 every weight is sharded and gathered for each forward and again for each
backward. For LoRA (and other adapters) the base is frozen, so those gathers move the same
bytes every step; on two CPU processes with gloo they were about 45% of the step time
(docs/benchmarks.md). ``frozen_base: replicate`` gathers the frozen weights once and keeps
them (``shard_model``); ``auto`` (the default) picks it when the gathered base fits the
memory budget, and says which it picked.
"""

import logging
import os
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

# The gathered base may take at most this share of the budget: the rest is for the
# activations, the chunked logits, the shards, gradients and optimizer state of the run.
_BASE_SHARE_OF_BUDGET = 0.5


def memory_budget_bytes(device: torch.device) -> int:
    """Memory one process may use: free CUDA memory, or available RAM per local process.

    Args:
        device: The training device.

    Returns:
        Bytes; on CPU ``MemAvailable`` (Linux) divided by the processes on this machine.
    """
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // max(1, local_processes)
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages // max(1, local_processes)


def frozen_bytes(model: nn.Module, *, mixed_precision: bool = False) -> int:
    """Bytes of the model's frozen parameters once gathered (bf16 under mixed precision).

    Works on a model on the meta device (sizes only). Tied parameters count once.
    """
    total = 0
    for param in model.parameters():
        if param.requires_grad:
            continue
        size = 2 if mixed_precision and param.is_floating_point() else param.element_size()
        total += param.numel() * size
    return total


def choose_frozen_base(
    setting: Literal["auto", "replicate", "shard"],
    model: nn.Module,
    device: torch.device,
    *,
    mixed_precision: bool = False,
) -> Literal["replicate", "shard"]:
    """Resolve the ``frozen_base`` setting for ``model`` (built, adapters applied, not sharded).

    ``auto`` replicates when the gathered frozen base takes at most half of the smallest
    rank's memory budget (:func:`memory_budget_bytes`; the other half is for activations and
    the rest of the run), and logs the choice on rank 0. One process, or a model without
    frozen weights, always gets ``shard`` (nothing to gather).

    Args:
        setting: The recipe's ``frozen_base``.
        model: The model, typically on the meta device.
        device: The training device.
        mixed_precision: Whether the gathered copy is bf16.

    Returns:
        ``replicate`` or ``shard``.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    base = frozen_bytes(model, mixed_precision=mixed_precision)
    if world_size == 1 or base == 0:
        return "shard"
    if setting != "auto":
        return setting
    budget = torch.tensor([memory_budget_bytes(device)], dtype=torch.float64)
    budget = budget.to(device) if device.type == "cuda" else budget
    dist.all_reduce(budget, op=dist.ReduceOp.MIN)  # every rank must decide the same
    budget_bytes = int(budget.item())
    choice = "replicate" if base <= _BASE_SHARE_OF_BUDGET * budget_bytes else "shard"
    if dist.get_rank() == 0:
        logger.info(
            "frozen_base: auto picked %s (gathered frozen base %.2f GiB, memory budget per "
            "process %.2f GiB)",
            choice,
            base / 2**30,
            budget_bytes / 2**30,
        )
    return choice
