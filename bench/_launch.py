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


def one_process_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus what torchrun gives the one process of a 1-process job (no agent store)."""
    return env | {
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0",
        "ROLE_NAME": "default", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()), "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }  # fmt: skip


def torchrun(
    script: str | os.PathLike,
    args: Sequence[str],
    nproc: int,
    env: dict[str, str] | None = None,
    **kwargs: Any,
):
    """Run ``script`` under ``python -m torch.distributed.run`` with ``nproc`` processes.

    One process is started directly, with torchrun's environment, as ``tunelab run`` starts
    one: the script runs the same, without the agent process, whose torch import costs ~1.5
    CPU-s a launch.

    Args:
        script: The script to run.
        args: Its arguments.
        nproc: Processes.
        env: Their environment (default: :func:`launch_env`).
        **kwargs: For ``subprocess.run`` (where stdout and stderr go).

    Returns:
        The ``subprocess.CompletedProcess``.
    """
    env = launch_env(nproc) if env is None else env
    if nproc == 1:
        command = [sys.executable, str(script), *args]
        return subprocess.run(command, env=one_process_env(env), **kwargs)
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc), "--master-port", str(free_port()),
        str(script), *args,
    ]  # fmt: skip
    return subprocess.run(command, env=env, **kwargs)


def relaunch_under_torchrun(nproc: int = 2) -> None:
    """Re-run the calling script under torchrun unless it already runs under it.

    Exits the launching process with torchrun's exit status. Called at the top of a script,
    before its imports, the launching process stays light (see the module's docstring).
    """
    if "LOCAL_RANK" in os.environ:
        return
    sys.exit(torchrun(sys.argv[0], sys.argv[1:], nproc).returncode)
