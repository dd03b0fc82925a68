"""Process-group set-up and teardown.

Every recipe calls :func:`init_distributed` first thing, before anything that may need a
process group (the checkpoint client in particular). ``tunelab run`` without torchrun options
still sets the torchrun environment for one process, so one code path serves 1 and N processes.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    """Global rank of this process."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node (selects the CUDA device)."""
    device: torch.device
    """The device this process computes on."""

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the process that logs and writes shared files."""
        return self.rank == 0


def _backend_for(device: torch.device) -> str:
    # A CPU-only build has no NCCL: "cpu:gloo,cuda:nccl" fails at init there (TORCH_NOTES).
    # On CUDA, the gloo side serves async checkpoint staging and other CPU collectives.
    if device.type == "cuda" and dist.is_nccl_available():
        return "cuda:nccl,cpu:gloo"
    return "gloo"


def init_distributed(device: str | None = None) -> DistInfo:
    """Initialise the default process group from the torchrun environment.

    Args:
        device: ``"cpu"``, ``"cuda"`` or None to pick CUDA when available.

    Returns:
        The rank, world size, local rank and device of this process.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        torch_device = torch.device("cuda", local_rank)
        torch.cuda.set_device(torch_device)
    if not dist.is_initialized() and "MASTER_ADDR" in os.environ:
        dist.init_process_group(
            backend=_backend_for(torch_device),
            rank=rank,
            world_size=world_size,
            device_id=torch_device if torch_device.type == "cuda" else None,
        )
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=torch_device)


def destroy_distributed() -> None:
    """Tear the default process group down, if one exists.

    Waits for every rank first: a rank tearing gloo down while a peer is still finishing its
    last collective can abort the peer at exit.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks in place and return it (a no-op without a group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value
