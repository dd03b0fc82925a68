"""One run per output_dir: a lock that rank 0 holds for the whole life of its process.

Two runs writing into one output_dir would interleave their step checkpoints, metrics and
exports, and a resume would pick up whichever committed last. So rank 0 takes an exclusive
``fcntl.flock`` on ``{output_dir}/.tunelab.lock`` right after the process group is up and keeps
the file open until the process ends. The kernel drops a ``flock`` when its process dies, by
SIGKILL too, so a killed run never leaves a stale lock behind. The file holds the holder's
host, pid and start time, for the message a second run stops with.

Multi-node: only global rank 0 locks. On a shared filesystem ``flock`` is only as good as the
filesystem's lock support: NFSv4, GPFS and Lustre mounted with ``-o flock`` lock across nodes;
NFS mounted with ``nolock`` or Lustre with ``localflock`` lock per node only, so two runs
started on different nodes are not detected; a filesystem without locks makes ``flock`` fail,
and the run goes on with a warning, unprotected.
"""

import errno
import json
import logging
import os
import socket
import time
from datetime import datetime
from pathlib import Path

from tunelab.errors import CheckpointError

try:
    import fcntl
except ImportError:  # Windows: no flock; the lock is skipped with a warning.
    fcntl = None

logger = logging.getLogger(__name__)

LOCK_FILE_NAME = ".tunelab.lock"
"""The lock file inside an output_dir."""
_HOLDER_BYTES = 4096
# `tunelab run` checks the lock by taking and releasing it: if a run's rank 0 tries in that
# instant, it must not mistake the check for a run. Real holders keep the lock for hours.
_RETRY_S = 1.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# Locks this process holds, kept open until it exits: output_dir -> file descriptor.
_held: dict[Path, int] = {}


def lock_output_dir(output_dir: str | os.PathLike) -> None:
    """Make this run the only one writing into ``output_dir``, for the life of the process.

    Rank 0 creates ``output_dir`` if needed and takes the lock; every rank learns the outcome
    (a broadcast), so every rank raises the same error. Call it right after
    ``init_distributed()``, before loading anything or writing into ``output_dir``. Calling it
    again for a folder this process already holds does nothing.

    Args:
        output_dir: The run's output folder.

    Raises:
        CheckpointError: On every rank, when another live process holds the lock (the message
            names its host, pid and start time), or when called before the process group of a
            multi-process run exists.
    """
    rank, world_size = _rank_and_world_size()
    problem = None
    if rank == 0:
        try:
            _acquire(Path(output_dir))
        except CheckpointError as error:
            problem = str(error)
    if world_size > 1:
        problem = _broadcast_from_rank0(problem)
    if problem is not None:
        raise CheckpointError(problem)


def check_output_dir_free(output_dir: str | os.PathLike) -> None:
    """Raise if a live process holds ``output_dir``'s lock; write nothing.

    ``tunelab run`` calls this before it starts any process, so a second run into a busy
    output_dir stops in a second rather than after loading a model. It takes the lock and
    releases it at once: an answer for this instant only (the run's rank 0 takes it for good).

    Args:
        output_dir: The run's output folder (a missing folder is free).

    Raises:
        CheckpointError: When another process holds the lock, naming it.
    """
    path = Path(output_dir) / LOCK_FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        return
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise CheckpointError(
            f"{path} is a link; tunelab never writes through links in an output_dir: remove it"
        ) from None
    try:
        _lock_or_raise(fd, Path(output_dir), retry_s=0.0)
    finally:
        os.close(fd)  # Closing the descriptor releases the lock.


def _acquire(output_dir: Path) -> None:
    key = output_dir.resolve()
    if key in _held:
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    # No O_TRUNC: a second run must not wipe the holder's details before it reads them.
    # O_NOFOLLOW: a lock file that is a link must not make us write through it.
    try:
        fd = os.open(output_dir / LOCK_FILE_NAME, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise CheckpointError(
            f"{output_dir / LOCK_FILE_NAME} is a link; tunelab never writes through links in an "
            "output_dir: remove it"
        ) from None
    try:
        locked = _lock_or_raise(fd, output_dir, retry_s=_RETRY_S)
    except BaseException:
        os.close(fd)
        raise
    if not locked:
        os.close(fd)
        return
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    _held[key] = fd


def _lock_or_raise(fd: int, output_dir: Path, *, retry_s: float) -> bool:
    """Take the lock on ``fd``; False when the filesystem has no locks (warned)."""
    if fcntl is None:
        logger.warning("cannot lock %s on this OS", output_dir / LOCK_FILE_NAME)
        return False
    deadline = time.monotonic() + retry_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    f"output_dir {output_dir} is in use by another run ({_describe_holder(fd)}):"
                    " wait for it to end, or pick another output_dir"
                ) from None
            time.sleep(0.1)
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            logger.warning(
                "cannot lock %s (%s): another run into this output_dir would not be detected",
                output_dir / LOCK_FILE_NAME,
                error.strerror,
            )
            return False


def _describe_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, _HOLDER_BYTES, 0))
        return f"host {holder['host']}, pid {holder['pid']}, started {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        # The holder took the lock but has not written its details yet, or they are damaged.
        return "holder details unreadable"


def _rank_and_world_size() -> tuple[int, int]:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    import torch.distributed as dist  # Here, not at the top: `tunelab run` imports this module.

    if not dist.is_initialized():
        raise CheckpointError(
            "lock_output_dir needs the process group in a multi-process run: call "
            "tunelab.distributed.init_distributed() first"
        )
    return dist.get_rank(), dist.get_world_size()


def _broadcast_from_rank0(text: str | None) -> str | None:
    """Rank 0's ``text`` (or None) on every rank: one broadcast of a CPU byte buffer."""
    import torch
    import torch.distributed as dist

    # A CPU tensor, so it goes through gloo on a "cuda:nccl,cpu:gloo" group too.
    buffer = torch.zeros(_HOLDER_BYTES + 1, dtype=torch.uint8)
    if text is not None:
        data = text.encode()[:_HOLDER_BYTES]
        buffer[0] = 1
        buffer[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buffer, src=0)
    if buffer[0].item() == 0:
        return None
    return bytes(buffer[1:].tolist()).rstrip(b"\0").decode(errors="replace")
