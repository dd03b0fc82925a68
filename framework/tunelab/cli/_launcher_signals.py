"""``tunelab run``'s own stop signals: the first one's notice, the second one's hard stop.

The workers turn the first SIGTERM/SIGINT into a checkpoint at the next step boundary
(``tunelab.lifecycle.Preemption``), but a worker cannot say so while it hangs (in a reward, or
in a collective waiting for a rank that does), and it cannot act on a second signal then either:
a Python signal handler runs only when the process returns to Python. The launcher always can:

- **First signal**: it prints :func:`~tunelab.lifecycle.preemption.stopping_notice` at once
  (stderr), then passes the signal on (torchrun's shutdown, or the one process's).
- **The same signal again** within ``REPEAT_WINDOW_S`` (SLURM signals every process, a terminal
  every process of its group): nothing more.
- **Second signal**: it SIGKILLs every worker (and their own helper processes), prints
  :func:`~tunelab.lifecycle.preemption.second_signal_line` and exits with 128 + signal, at once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tunelab.lifecycle.preemption import (
    REPEAT_WINDOW_S,
    second_signal_line,
    stopping_notice,
)


class LauncherStop:
    """The launcher's handler for SIGTERM and SIGINT (see the module docstring).

    Args:
        on_first: Passes the first signal on (forward it; or raise torchrun's
            ``SignalException``, which shuts the workers down).
        workers: The worker processes' pids, when a second signal must kill them.
        temporary: Folders to remove before a second signal's exit.
    """

    def __init__(
        self,
        on_first: Callable[[int], None],
        workers: Callable[[], Iterable[int]],
        temporary: Iterable[Path] = (),
    ) -> None:
        self._on_first = on_first
        self._workers = workers
        self._temporary = list(temporary)
        self.signum: int | None = None
        self._first_at = 0.0

    def __call__(self, signum: int, frame: Any) -> None:
        """The signal handler."""
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            _write(2, f"\n{stopping_notice(signum)}\n")
            self._on_first(signum)
            return
        if now - self._first_at < REPEAT_WINDOW_S:
            return  # The first signal again, sent to every process.
        self.stop_at_once(signum)

    def stop_at_once(self, signum: int) -> None:
        """Kill every worker, print the second signal's line and exit (128 + signal)."""
        kill_now(self._workers())
        for folder in self._temporary:
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(Exception):
            sys.stderr.flush()
            sys.stdout.flush()
        _write(1, f"{second_signal_line(signum)}\n")
        os._exit(128 + signum)


def kill_now(pids: Iterable[int]) -> None:
    """SIGKILL each process, with its process group when it leads one (torchrun's workers do).

    A worker's group holds its own helper processes (a streaming dataset's read-ahead workers),
    which leave stop signals to it.
    """
    own_group = os.getpgrp()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(pid)
            if group == pid and group != own_group:
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


def _write(fd: int, text: str) -> None:
    # A signal handler: no Python stream lock, which the interrupted code may hold.
    with contextlib.suppress(OSError):
        os.write(fd, text.encode())
