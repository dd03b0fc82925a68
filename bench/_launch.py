"""Launching benchmark processes under torchrun, without importing torch.

A 2-process script calls :func:`relaunch_under_torchrun` before its own imports, so that the
process a user (or ``make bench``) starts only re-runs it under torchrun: it loads no torch and
no tunelab, whose imports cost seconds of CPU in every process that makes them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def free_port() -> int:
    """A TCP port that was free a moment ago (for torchrun's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env(nproc: int) -> dict[str, str]:
    """The environment of a benchmark launch: one share of the cores per process."""
    env = dict(os.environ)
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a worker that aborts shows where it was
    # torchrun would set 1 thread per process with a warning; say it explicitly instead, and
    # give a lone process every core.
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return env


def torchrun(script: str | os.PathLike, args: Sequence[str], nproc: int, **kwargs: Any):
    """Run ``script`` under ``python -m torch.distributed.run`` with ``nproc`` processes.

    Returns:
        The ``subprocess.CompletedProcess`` (stdout and stderr go where ``kwargs`` say).
    """
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc), "--master-port", str(free_port()),
        str(script), *args,
    ]  # fmt: skip
    return subprocess.run(command, env=launch_env(nproc), **kwargs)


def relaunch_under_torchrun(nproc: int = 2) -> None:
    """Re-run the calling script under torchrun unless it already runs under it.

    Exits the launching process with torchrun's exit status. Called at the top of a script,
    before its imports, the launching process stays light (see the module's docstring).
    """
    if "LOCAL_RANK" in os.environ:
        return
    sys.exit(torchrun(sys.argv[0], sys.argv[1:], nproc).returncode)
