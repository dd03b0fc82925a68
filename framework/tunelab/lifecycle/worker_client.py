"""The process torchrun starts for each worker when a zygote serves the launch (``zygote``).

``tunelab run`` starts each torchrun worker as ``python -u -c CLIENT_CODE RECIPE ARGS``
(:data:`tunelab.lifecycle.zygote.CLIENT_CODE`). This module is loaded by file path, not through
the ``tunelab`` package (whose ``__init__`` imports omegaconf and more): it imports only the
standard library. It asks the run's zygote to fork the worker, hands it its argv, environment,
working directory, umask, resource limits, signal mask and stdin/stdout/stderr, then stands in
for the worker: it forwards every signal it can catch to it and ends as it ended (the same exit
code, or killed by the same signal). When the zygote is off, gone, busy with threads or too
slow, it runs the recipe itself, exactly as ``WORKER_CODE`` does.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import signal
import socket
import struct
import sys

LAUNCH_SERVER_ENV = "TUNELAB_LAUNCH_SERVER"
"""The launch server's Unix socket: the ``tunelab`` command hands itself to it (``tunelab.cli.launch_server``)."""
SOCKET_ENV = "TUNELAB_ZYGOTE_SOCKET"
"""The zygote's Unix socket, set by ``tunelab run`` for the processes torchrun starts."""
FORWARDED_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)
"""The signals a client passes on to its worker (every one it can catch that a launcher sends)."""
READY_TIMEOUT_S = 180.0
"""How long a client waits for the zygote to finish its imports before it imports itself."""
_HEADER = struct.Struct("!I")
_STARTED = struct.Struct("!ci")


def main(thresholds: tuple[int, ...]) -> None:
    """Start the worker through the zygote and end as it ended, or run the recipe here.

    Args:
        thresholds: The collector's thresholds before ``CLIENT_CODE`` raised them (as
            ``WORKER_CODE``): the worker puts them back once its imports are done.
    """
    path = os.environ.pop(SOCKET_ENV, None)
    started = _start_worker(path, thresholds) if path else None
    if started is None:
        from tunelab.lifecycle.worker_start import run_recipe

        run_recipe(thresholds)
        return
    _stand_in(*started)


def hand_over_launch() -> None:
    """In the ``tunelab`` command: have the launch server run it, and end as that run ended.

    ``TUNELAB_LAUNCH_SERVER`` names the server's socket (``tunelab.cli.launch_server``).
    The server forks a process that runs the command with this one's argv, environment,
    working directory, umask, resource limits, signal mask and stdin/stdout/stderr; this one
    forwards every signal it can catch to it and exits with its exit code (or dies of its
    signal). Returns, having changed nothing, when the variable is unset or the server does
    not serve it (absent, dead, or its interpreter, flags or environment differ; ``--debug``
    says why).
    """
    path = os.environ.get(LAUNCH_SERVER_ENV, "")
    if not path:
        return
    ignored = [int(s) for s in FORWARDED_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)  # Until we forward.
    started = _start_worker(
        path,
        gc.get_threshold(),
        what="command runs",
        # The mask from before the block above (the request's own is read after it).
        extra={
            "ignored": ignored,
            "pid": os.getpid(),
            "path0": sys.path[0],
            "mask": sorted(int(s) for s in mask),
        },
    )
    if started is None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return
    if _debug_enabled():
        _write_debug(f"the launch server runs this command (pid {started[1]})")
    _stand_in(*started, group=False)


def _debug_enabled() -> bool:
    return (
        os.environ.get("TUNELAB_DEBUG", "") not in ("", "0")
        or os.environ.get("TUNELAB_LOG_LEVEL", "").strip().upper() == "DEBUG"
        or "--debug" in sys.argv[1:]
    )


def _write_debug(line: str) -> None:
    try:
        os.write(2, f"tunelab: debug: {line}\n".encode())
    except OSError:
        pass


def _debug(line: str) -> None:
    if _debug_enabled():
        _write_debug(line)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _start_worker(
    path: str,
    thresholds: tuple[int, ...],
    what: str = "worker starts",
    extra: dict | None = None,
) -> tuple[socket.socket, int] | None:
    """Have the zygote fork this worker; its socket and pid, or None to run it here.

    ``what`` starts the ``--debug`` line that says why not; ``extra`` joins the request.
    """
    server = "the launch server" if extra is not None else "the zygote"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    committed = False
    try:
        sock.settimeout(READY_TIMEOUT_S)
        sock.connect(path)
        request = {
            "argv": sys.argv,
            "orig_argv": getattr(sys, "orig_argv", None),
            "executable": sys.executable,
            "version": sys.version,
            "flags": list(sys.flags),
            "warnoptions": sys.warnoptions,
            "xoptions": {str(k): str(v) for k, v in sys._xoptions.items()},
            "environ": dict(os.environ),
            "cwd": os.getcwd(),
            "umask": _umask(),
            "rlimits": resource_limits(),
            "affinity": sorted(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else None,
            "priority": os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None,
            "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "thresholds": list(thresholds),
            "unbuffered": bool(getattr(sys.stdout, "write_through", False)),
            "cmdline": _read_latin1("/proc/self/cmdline"),
            "proc_environ": _read_latin1("/proc/self/environ"),
            **(extra or {}),
        }
        payload = json.dumps(request).encode()
        socket.send_fds(sock, [_HEADER.pack(len(payload))], [0, 1, 2])
        sock.sendall(payload)
        answer = sock.recv(1)
        if answer != b"R":
            reason = sock.recv(4096).decode(errors="replace") if answer == b"N" else "no answer"
            _debug(f"{what} without {server}: {reason}")
            return None
        sock.sendall(b"G")
        committed = True
        # The zygote forks at once: no timeout from here (a zygote that died closes the socket,
        # and a worker it forked dies with it).
        sock.settimeout(None)
        reply = _receive_exactly(sock, _STARTED.size)
        if len(reply) != _STARTED.size or reply[:1] != b"P":
            _debug(f"{what} without {server}: it closed before starting it")
            return None
        return sock, _STARTED.unpack(reply)[1]
    except (OSError, ValueError) as err:
        if committed:
            _debug(f"{what} without {server}: {err}")
        else:
            _debug(f"{what} without {server}: {type(err).__name__}: {err}")
        sock.close()
        return None


def resource_limits() -> dict[str, list[int]]:
    """This process's resource limits (``ulimit``), by ``RLIMIT_*`` name: [soft, hard]."""
    return {
        name: list(resource.getrlimit(getattr(resource, name)))
        for name in dir(resource)
        if name.startswith("RLIMIT_")
    }


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _read_latin1(path: str) -> str | None:
    try:
        with open(path, "rb") as file:
            return file.read().decode("latin-1")
    except OSError:
        return None


def _stand_in(sock: socket.socket, pid: int, group: bool = True) -> None:
    """Forward signals to the worker, wait for its end, and end the same way.

    ``group``: signal the worker's process group (torchrun's workers); otherwise the process
    alone (a served ``tunelab`` command, whose one-process child is in its group and gets
    the signal from it, as from a ``tunelab`` started directly).
    """

    def forward(signum: int, frame: object) -> None:
        try:
            if not group:
                os.kill(pid, signum)
                return
            os.killpg(pid, signum)  # Its group, as torchrun signals a worker's (helpers too).
        except OSError:
            try:
                os.kill(pid, signum)  # It has not made its own group yet.
            except OSError:
                pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    if group:
        _hide_command_line(pid)
    # Stop signals that came while the worker was being started were pending: forward them now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
    reply = _receive_exactly(sock, _STARTED.size)
    if len(reply) != _STARTED.size or reply[:1] != b"X":
        # The zygote died, and its workers with it (their parent-death signal).
        _end_by_signal(signal.SIGKILL)
    code = _STARTED.unpack(reply)[1]
    if code < 0:
        _end_by_signal(-code)
    os._exit(code)


def _end_by_signal(signum: int) -> None:
    """Die of ``signum``, so the launcher sees what the worker died of."""
    for forwarded in FORWARDED_SIGNALS:
        signal.signal(forwarded, signal.SIG_IGN)  # Nothing more to forward.
    if signum != signal.SIGKILL:
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # A signal that does not kill by default (SIGCHLD, SIGURG, ...).


def _hide_command_line(pid: int) -> None:
    """Rewrite this process's ``/proc`` command line: the worker shows it instead.

    Tools that find a run's workers by their command line (``pgrep -f OUTPUT_DIR``) then find
    each worker once, not its stand-in too.
    """
    area = _argument_area()
    if area is None:
        return
    start, end = area
    title = f"tunelab worker client (worker pid {pid})".encode()[: end - start - 1]
    _write_memory(start, title.ljust(end - start, b"\0"))


def _argument_area() -> tuple[int, int] | None:
    """Where the kernel reads this process's command line from (``/proc/self/stat``)."""
    fields = _stat_fields()
    return (fields[45], fields[46]) if fields else None


def _stat_fields() -> list[int] | None:
    # Fields after the command name; field n of proc(5) is index n - 3 (arg_start is 48).
    try:
        with open("/proc/self/stat", "rb") as file:
            text = file.read()
        fields = [int(field) for field in text.rsplit(b")", 1)[1].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    fields = [0, *fields]  # Index 0 stands for the state letter.
    return fields if len(fields) > 48 and fields[45] < fields[46] else None


def _write_memory(address: int, data: bytes) -> None:
    import ctypes

    ctypes.memmove(address, data, len(data))
