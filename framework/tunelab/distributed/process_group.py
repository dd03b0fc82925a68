"""Process-group set-up and teardown.

Every recipe calls :func:`init_distributed` first thing, before anything that may need a
process group (the checkpoint client in particular). ``tunelab run`` without torchrun options
still sets the torchrun environment for one process, so one code path serves 1 and N processes.

Every collective of the run (the default group, and the groups made later with
:func:`collective_timeout` passed on) gives up after ``collective_timeout_s``: a peer that hangs
or froze turns into an exception, the worker exits, and torchrun (``--max-restarts``) restarts
the group instead of everyone waiting forever.
"""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# The run's collective timeout; None: torch's defaults (30 min for gloo, 10 for NCCL).
_timeout: timedelta | None = None


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


def init_distributed(
    device: str | None = None,
    *,
    collective_timeout_s: float | None = None,
    store: dist.Store | None = None,
) -> DistInfo:
    """Initialise the default process group from the torchrun environment.

    Args:
        device: ``"cpu"``, ``"cuda"`` or None to pick CUDA when available.
        collective_timeout_s: Seconds a collective waits for its peers before it raises
            (gloo and NCCL both honour it), so a hung peer ends in a restart, not a hang;
            None keeps torch's default. The recipes pass ``collective_timeout_s``.
        store: The rendezvous store of the group (None: the torchrun environment's); an
            asynchronous GRPO rank split (``tunelab.rl.split_ranks``) passes the trainers' own.

    Returns:
        The rank, world size, local rank and device of this process.
    """
    global _timeout
    _timeout = None if collective_timeout_s is None else timedelta(seconds=collective_timeout_s)
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
            timeout=_timeout,
            store=store,
        )
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=torch_device)


def collective_timeout() -> timedelta | None:
    """The run's collective timeout: pass it to ``dist.new_group`` so side groups honour it."""
    return _timeout


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
