"""A long-lived process that runs ``tunelab`` commands forked from pre-imported state.

Every ``tunelab run`` imports the same modules before it does anything of its own: the
launcher torch and ``torch.distributed.run`` (some 1.75 CPU-s here), its worker zygote torch,
DTensor, ``torch._dynamo``, DCP and tunelab again (``zygote``). A test suite or tool that
launches hundreds of small runs pays that for each. The launch server pays it once: started
with ``python -c SERVER_CODE`` (:func:`start_server`), it imports all of that, runs no torch
operation, stays single-threaded and serves a Unix socket. With ``TUNELAB_LAUNCH_SERVER=PATH``
set, the ``tunelab`` command, before any heavy import (``tunelab.cli``'s first lines), hands
its argv, environment, working directory, umask, resource limits, signal mask, ignored signals
and stdin/stdout/stderr to the server through the worker zygote's protocol (``worker_client``);
the server forks a child that takes them all on, starts a session of its own and runs the
command's ``main`` as a fresh ``tunelab`` process would, while the command's own process stands
in for it: it forwards every signal it can catch to the child and exits as the child exited
(its exit code, or killed by the same signal).

The child, a ``tunelab run`` with torchrun options, forks its worker zygote from itself while
it is still single-threaded and untouched by the command (``zygote.fork_template``); the
zygote then imports only what the recipe adds.

Lifetimes: the server dies with the process that started it (``PR_SET_PDEATHSIG``); a child
dies with the server, and when its stand-in dies (SIGKILL) the server SIGKILLs the child's
process group, and its workers die with it as with any launcher. The stand-in keeps its own
``/proc`` command line and environment (it is the command a user or a test sees); the child
shows a title naming its stand-in.

What differs from a fresh process: the child shares the server's string-hash seed, it has
every module the server imported (the launcher's and the zygote's both), and its session is
its own, not its stand-in's (a signal to the stand-in's group reaches the child through the
stand-in once, as a signal to the child alone). The server refuses a command whose
interpreter, flags or environment differ from its own, apart from ``TUNELAB_*`` and
``PYTEST_*`` variables, which nothing reads at import, or one of whose hard resource limits is
above its own (a lower one the child takes on); the command then runs as it always did.

Meant for test harnesses and tools that launch many runs: the tests start one server per
pytest worker (``tests/recipes/conftest.py``).
"""

from __future__ import annotations

import gc
import importlib
import os
import socket
import subprocess
import sys

from tunelab.lifecycle.parent_death import set_parent_death_signal
from tunelab.lifecycle.worker_client import LAUNCH_SERVER_ENV  # noqa: F401 - its home here
from tunelab.lifecycle.worker_start import IMPORT_THRESHOLD
from tunelab.lifecycle.zygote import (
    ENVIRONMENT_PAD,
    ForkServer,
    become_worker,
    flush_stdio,
    fork_refusal,
    fork_template,
    show_as,
    zygote_enabled,
)

__all__ = ["LAUNCH_SERVER_ENV", "SERVER_CODE", "refusal", "serve", "start_server"]

SERVER_CODE = "from tunelab.cli.launch_server import serve; serve()"
"""What ``python -c`` runs in the launch server (argv: its socket path, then padding)."""
_PAD_ENV = "TUNELAB_LAUNCH_SERVER_PAD"
_LISTENER_ENV = "TUNELAB_LAUNCH_SERVER_LISTENER"
# Room in the server's /proc command line for its children's titles and for the command
# lines of the workers its launchers' zygotes fork (``zygote.show_as``).
_COMMAND_LINE_PAD = 16384
# Environment variables that may differ between the server and a command it runs: nothing
# reads them at import (tunelab reads its own when it acts; pytest names the running test).
_FREE_PREFIXES = ("TUNELAB_", "PYTEST_")
_FREE_KEYS = frozenset({"_", "SHLVL", "PWD", "OLDPWD"})  # What a shell sets per command.
# What a launcher and its worker zygote import before they do anything of their own.
_IMPORTS = (
    "tunelab",
    "tunelab.cli.main",
    "torch",
    "torch.distributed",
    "torch.distributed.run",
    "torch.distributed.elastic.multiprocessing",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "tunelab.lifecycle.entry",
    "tunelab.training",
    "tunelab.checkpoint.client",
    "tunelab.checkpoint.export",
)


def start_server(path: str, env: dict[str, str] | None = None, log: str | None = None):
    """Start a launch server on the Unix socket ``path`` (a fresh interpreter, never a fork).

    The server dies with the thread that calls this. Commands that should use it need
    ``TUNELAB_LAUNCH_SERVER=path`` and the same environment ``env`` (apart from ``TUNELAB_*``
    and ``PYTEST_*``). Give it ``OMP_NUM_THREADS=1``: otherwise numpy's OpenBLAS starts threads
    at import, and a server with threads refuses every command (they then run cold).

    Args:
        path: The socket to serve (its folder must exist; a stale socket is replaced). It
            shows in the server's command line.
        env: The server's environment (``os.environ`` when None).
        log: A file for the server's own output (otherwise /dev/null).

    Returns:
        The server's ``subprocess.Popen``. The socket exists when this returns: a command
        that connects before the server's imports are done waits for them.
    """
    env = dict(os.environ if env is None else env)
    env[_PAD_ENV] = "x" * ENVIRONMENT_PAD  # Room for the children's environments too.
    try:
        os.unlink(path)
    except OSError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child's copy
    try:
        listener.bind(path)
        listener.listen(128)
        env[_LISTENER_ENV] = str(listener.fileno())
        return subprocess.Popen(
            [sys.executable, "-c", SERVER_CODE, path, " " * _COMMAND_LINE_PAD],
            env=env,
            pass_fds=(listener.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,  # Signals to the caller's group are not for it.
            cwd=os.path.dirname(os.path.abspath(path)) or None,
        )
    finally:
        listener.close()  # The server's copy serves; a dead server then refuses connections.
        if log:
            out.close()


def serve() -> None:
    """The server's main (``SERVER_CODE``): import, then fork commands until its parent ends.

    Returns only in a forked command, after it ran (``sys.exit`` with its code).
    """
    starter = os.getppid()
    if not set_parent_death_signal() or os.getppid() != starter:
        os._exit(0)
    os.environ.pop(_PAD_ENV, None)
    sys.path[0] = os.path.dirname(sys.executable)  # Not `python -c`'s working directory.
    listener = socket.socket(fileno=int(os.environ.pop(_LISTENER_ENV)))
    thresholds = gc.get_threshold()
    gc.set_threshold(IMPORT_THRESHOLD, *thresholds[1:])
    importlib.import_module("tunelab")  # Its environment defaults are every command's.
    baseline = dict(os.environ)
    for name in _IMPORTS:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a command meets it itself, as before
            continue
    imported = {key: os.environ.get(key) for key in baseline.keys() | os.environ.keys()}
    imported = {key: value for key, value in imported.items() if baseline.get(key) != value}
    gc.set_threshold(*thresholds)  # A fresh `tunelab` command collects as usual.
    gc.collect()
    gc.freeze()  # What the commands share: their collections never walk it.
    flush_stdio()  # What the imports printed is the server's, not a command's.
    request, fds, conn, server = ForkServer(listener, baseline, refusal).serve()
    become_worker(request, fds, conn, server, imported, launch=True)
    show_as(f"tunelab launch server child (stand-in pid {request['pid']})\0", None)
    sys.path[0] = request["path0"]  # The `tunelab` script's folder, as a fresh command has.
    if _wants_zygote(request["argv"][1:]) and not fork_template():
        return  # A worker whose recipe ran: it ends as `python -c ZYGOTE_CODE` would.
    from tunelab.cli.main import main

    main()


def _wants_zygote(argv: list[str]) -> bool:
    """Whether a command may launch through torchrun with a zygote (``run`` or ``eval``)."""
    words = [word for word in argv if word != "--debug"]
    return (
        len(words) > 1
        and words[0] in ("run", "eval")
        and words[1].startswith("-")
        and zygote_enabled()
    )


def refusal(request: dict, baseline: dict[str, str]) -> str | None:
    """Why the server must not run the command ``request`` describes, or None.

    As the zygote's rules (one thread, no CUDA, the same interpreter and flags), with the
    environment compared apart from ``TUNELAB_*`` and ``PYTEST_*`` variables and what a shell
    sets for each command (``_``, ``SHLVL``, ``PWD``, ``OLDPWD``).

    Args:
        request: The command's request (``worker_client``).
        baseline: The server's environment before its imports.

    Returns:
        The reason, or None.
    """
    environ = request["environ"]
    free = {
        key
        for key in baseline.keys() | environ.keys()
        if key.startswith(_FREE_PREFIXES) or key in _FREE_KEYS
    }
    reason = fork_refusal(
        {**request, "environ": {k: v for k, v in environ.items() if k not in free}},
        {k: v for k, v in baseline.items() if k not in free},
    )
    if reason is not None:
        return reason.replace("the zygote", "the launch server").replace("worker's", "command's")
    return None
