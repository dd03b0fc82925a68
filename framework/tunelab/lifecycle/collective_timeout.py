"""A collective that timed out: what the waiting rank was doing, and which rank never came.

A rank that hangs (a reward stuck on one rank, a deadlock, a frozen process) shows up on its
peers: their next collective waits ``parallelism.collective_timeout_s`` and raises (gloo:
``RuntimeError: ... Timed out waiting 5000ms for send operation to complete``). That message
names neither the collective nor the rank it waited for. :func:`describe_timeout` reads both
from the exception: the collective is the outermost ``torch.distributed`` call in the
traceback, the place is the innermost frame of the caller's code before it; the rank is the
peer in a 2-process run.

``recipe_main`` records the result in the rank's error file (:data:`RECORD_KEY`), so that
``tunelab run``, which sees how every rank ended, can name the ranks that did not arrive in
any world size: those that did not time out in a collective themselves (it stopped them after
the waiting rank failed).

Nothing here imports torch: ``tunelab run`` formats the line without it.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RECORD_KEY = "tunelab_collective_timeout"
"""The key of a timeout's fields in a worker's error record (torchrun's error file)."""

PEER_CLOSED_KEY = "tunelab_peer_closed"
"""Set (true) in a worker's error record when it failed because a peer's connection closed.

Such a failure is the consequence of another rank's exit, never the cause: ``tunelab run``
reports a rank that failed on its own before it, whichever recorded its line first.
"""

_TORCH_DISTRIBUTED = re.compile(r"[/\\]torch[/\\]distributed[/\\]")
_TORCH = re.compile(r"[/\\]torch[/\\]")
_C10D = re.compile(r"[/\\]torch[/\\]distributed[/\\]distributed_c10d\.py$")
_TIMED_OUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)
_MILLISECONDS = re.compile(r"(\d+)\s*ms\b")
# The transports' words for a peer whose end of the connection went away (gloo, NCCL).
_PEER_CLOSED = re.compile(
    r"connection (?:closed|reset) by peer|broken pipe|remote process exited|"
    r"communicator was aborted",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class CollectiveTimeout:
    """A collective this rank waited in until it timed out.

    Attributes:
        rank: The rank that waited.
        world_size: The number of ranks.
        operation: The collective (``all_gather_object``, ``all_reduce``, ...).
        caller: Where this rank called it: ``function (tunelab/training/grpo.py:251)``.
        timeout_s: How long it waited (``parallelism.collective_timeout_s``), when known.
        log_path: The rank's log file with the traceback, when written.
    """

    rank: int
    world_size: int
    operation: str
    caller: str
    timeout_s: float | None
    log_path: str | None = None

    def to_record(self) -> dict[str, Any]:
        """The fields as JSON values, for the rank's error record."""
        return asdict(self)

    @classmethod
    def from_record(cls, record: object) -> CollectiveTimeout | None:
        """The timeout a worker recorded (see :data:`RECORD_KEY`), or None."""
        fields = record.get(RECORD_KEY) if isinstance(record, dict) else None
        if not isinstance(fields, dict):
            return None
        try:
            return cls(**fields)
        except TypeError:
            return None

    def line(self, missing: list[int] | None = None) -> str:
        """One line: the collective, where this rank waited in it, for whom, how long.

        Args:
            missing: The ranks that did not arrive, when known (``tunelab run`` knows them);
                None: the other rank of a 2-process run, else "a rank".
        """
        if missing is None and self.world_size == 2:
            missing = [1 - self.rank]
        if missing:
            names = " and ".join(str(rank) for rank in missing)
            whom = f"rank{'s' if len(missing) > 1 else ''} {names}, which did not arrive"
        else:
            whom = "a rank that did not arrive"
        waited = (
            f" {self.timeout_s:g} s (parallelism.collective_timeout_s)" if self.timeout_s else ""
        )
        where = f" (traceback in {self.log_path})" if self.log_path else ""
        return (
            f"rank {self.rank}: collective {self.operation} timed out: {self.caller} waited"
            f"{waited} for {whom}{where}"
        )


def describe_timeout(
    err: BaseException, *, rank: int, world_size: int, timeout_s: float | None = None
) -> CollectiveTimeout | None:
    """The collective ``err`` timed out in, or None when it is not a collective's timeout.

    Args:
        err: The exception the rank failed with (its traceback is read).
        rank: This rank.
        world_size: The number of ranks.
        timeout_s: The run's collective timeout, if known; else read from the message (``5000ms``).

    Returns:
        The collective and its caller, or None.
    """
    if world_size < 2 or not _TIMED_OUT.search(str(err)):
        return None
    frames = traceback.extract_tb(err.__traceback__)
    inside = [i for i, frame in enumerate(frames) if _TORCH_DISTRIBUTED.search(frame.filename)]
    if not inside:
        return None
    c10d = [i for i in inside if _C10D.search(frames[i].filename)]
    first = (c10d or inside)[0]
    callers = [frame for frame in frames[:first] if not _TORCH.search(frame.filename)]
    caller = callers[-1] if callers else frames[first]
    if timeout_s is None:
        found = _MILLISECONDS.search(str(err))
        timeout_s = int(found.group(1)) / 1000 if found else None
    return CollectiveTimeout(
        rank=rank,
        world_size=world_size,
        operation=frames[first].name,
        caller=f"{caller.name} ({_short_path(caller.filename)}:{caller.lineno})",
        timeout_s=timeout_s,
    )


def peer_closed(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) says a peer's connection closed.

    A rank that fails or exits closes its connections; each peer then waiting on it fails
    with the transport's ``Connection closed by peer`` (gloo) or ``remote process exited``
    (NCCL), often in the same second as the rank that caused it.
    """
    seen: set[int] = set()
    error: BaseException | None = err
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if _PEER_CLOSED.search(str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def _short_path(filename: str) -> str:
    """``tunelab/training/grpo.py`` or ``recipes/grpo_distributed.py``; else the file's name."""
    parts = Path(filename).parts
    for root in ("tunelab", "recipes"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root) :])
    return Path(filename).name
