"""Workers never outlive their launcher.

torchrun starts each worker in a session of its own (``start_new_session=True``), so when the
launcher dies without the chance to stop them (SIGKILL, the OOM killer, a dead node agent)
nothing else does: measured on torch 2.13, orphaned workers train on and keep writing
checkpoints into an output_dir that a new run may already be using. So each worker asks the
kernel to SIGKILL it the moment its parent dies: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux,
a thread polling the parent pid elsewhere.

``PR_SET_PDEATHSIG`` fires when the parent *thread* that forked the worker exits, not the
parent process. Both of ``tunelab run``'s paths fork from the launcher's main thread (torchrun's
agent runs there and spawns workers with ``subprocess.Popen``; the one-process path is a plain
``subprocess.Popen``), and the main thread lives as long as the launcher.

There is a race: the launcher can die after forking the worker and before the worker asks
for the signal (a few seconds of Python and torch imports). Then the worker's parent is
already init or a subreaper and the signal would never come. ``tunelab run`` exports its pid
in ``TUNELAB_LAUNCHER_PID``; a worker whose parent is not that pid exits at once.
"""

import ctypes
import os
import signal
import sys
import threading
import time

LAUNCHER_PID_ENV = "TUNELAB_LAUNCHER_PID"
"""Set by ``tunelab run`` to its own pid for the processes it starts."""
_PR_SET_PDEATHSIG = 1  # From <linux/prctl.h>.
_POLL_INTERVAL_S = 0.5


def exit_with_launcher() -> None:
    """Make this process die (SIGKILL) when the process that launched it dies.

    Acts only in a launched process: one started by ``tunelab run`` (``TUNELAB_LAUNCHER_PID``
    set, then removed from the environment so this process's own children do not inherit
    it) or by torchrun (``TORCHELASTIC_RUN_ID`` set). A recipe started by hand from a shell is
    left alone: its parent is the shell, and ``nohup`` must keep working.

    Call it first thing in the process (``recipe_main`` does).
    """
    launcher_pid = _launcher_pid()
    if launcher_pid is None and "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    expected_parent = launcher_pid if launcher_pid is not None else os.getppid()
    if not (sys.platform.startswith("linux") and set_parent_death_signal(signal.SIGKILL)):
        threading.Thread(
            target=_watch_parent, args=(expected_parent,), daemon=True, name="tunelab-parent"
        ).start()
    if os.getppid() != expected_parent:
        # The launcher died before the kernel knew to tell us.
        _die(expected_parent)


def _launcher_pid() -> int | None:
    value = os.environ.pop(LAUNCHER_PID_ENV, None)
    try:
        return int(value) if value else None
    except ValueError:
        return None


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux prctl).

    Returns:
        Whether the kernel took it (False off Linux or where prctl is missing).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(expected_parent: int) -> None:
    while os.getppid() == expected_parent:
        time.sleep(_POLL_INTERVAL_S)
    _die(expected_parent)


def _die(launcher_pid: int) -> None:
    try:
        # Raw write: no Python stream lock to contend with; a closed pipe is no reason to stay.
        os.write(2, f"tunelab: launcher (pid {launcher_pid}) is gone; exiting\n".encode())
    except OSError:
        pass
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(128 + 9)  # Windows: no SIGKILL; the same code a shell shows for one.
