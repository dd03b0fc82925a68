"""Workers forked from a pre-imported, single-threaded zygote (``tunelab run`` under torchrun).

Every worker of a launch imports the same modules first: torch, DTensor, ``torch._dynamo``
(torch imports it), tunelab and the recipe's own imports, some 3.5 CPU-s per process on these
machines, and the launch of N workers pays it N times. So before torchrun starts, ``tunelab
run`` starts one zygote per launch (:func:`start_zygote`): a plain subprocess that imports all
of that once, runs no torch operation (no OpenMP or MKL thread pool exists) and serves a Unix
socket in a private temporary folder. torchrun keeps its own process model (error files,
signals, restarts, rendezvous, log redirects): the process it starts for each worker is a thin
client (``worker_client``, :data:`CLIENT_CODE`) that sends the zygote its argv, environment,
working directory, umask, resource limits, signal mask and its stdin/stdout/stderr
(``SCM_RIGHTS``). The zygote checks that it is still single-threaded (``threading`` and
``/proc/self/task``) and forks the worker, which takes all of that on, starts a session of its
own (as torchrun's workers do) and runs the recipe as ``__main__`` exactly as ``WORKER_CODE``
does. The client forwards every signal it can catch to the worker's process group, and ends
as the worker ended: its exit code, or killed by the same signal (an OOM SIGKILL looks as it
always did).

Lifetimes: the zygote dies with the launcher (``PR_SET_PDEATHSIG`` and the launcher's pid), and
the launcher kills it when torchrun returns; a forked worker dies with the zygote (its own
parent-death signal, set right after the fork and again by ``recipe_main``); when a client dies
(torchrun SIGKILLs it) the zygote SIGKILLs its worker's group. A worker shows the command line
and environment of its client in ``/proc`` (the zygote's are padded to make room), and the
client hides its own, so tools that find a run's workers by command line find each one once.

A fresh interpreter in each worker is what the fork must be indistinguishable from: Python's
``random`` reseeds itself after a fork and numpy's global generator is reseeded here; torch's
default generator was never used in the zygote, so it holds its fixed default seed, as at
import. One difference stays: every forked worker shares the zygote's string-hash seed
(``PYTHONHASHSEED``), where fresh processes would each draw their own.

A ``tunelab run`` forked by the launch server (``tunelab.cli.launch_server``) has the zygote's imports
already: it forks its zygote from itself (:func:`fork_template`) before the command does
anything, still single-threaded, and hands it the recipe, the listening socket and the
workers' environment when :func:`start_zygote` is called; that zygote then imports only what
the recipe adds. Its stdio is the server's (no ``-u``), so each worker it forks gets stdio as
``python -u`` makes it (:func:`fresh_stdio`).

Whenever the zygote cannot serve a worker (``TUNELAB_WORKER_ZYGOTE=0``, it failed to start,
died, still imports after ``READY_TIMEOUT_S``, runs a thread, or the worker's interpreter,
flags or import-relevant environment differ from its own) the client runs the recipe itself,
as before; ``--debug`` says why.
"""

from __future__ import annotations

import ast
import ctypes
import gc
import importlib
import io
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from tunelab.lifecycle.parent_death import LAUNCHER_PID_ENV, set_parent_death_signal
from tunelab.lifecycle.worker_client import FORWARDED_SIGNALS, SOCKET_ENV, resource_limits
from tunelab.lifecycle.worker_start import IMPORT_THRESHOLD, run_recipe

ZYGOTE_ENV = "TUNELAB_WORKER_ZYGOTE"
"""``0`` starts every torchrun worker as its own interpreter, without the zygote."""
_LISTENER_ENV = "TUNELAB_ZYGOTE_LISTENER"
_RECIPE_ENV = "TUNELAB_ZYGOTE_RECIPE"
_PAD_ENV = "TUNELAB_ZYGOTE_PAD"
_OWN_ENV = (_LISTENER_ENV, _RECIPE_ENV, _PAD_ENV)
# Room in the zygote's /proc environment for a worker's (torchrun adds some 600 bytes).
ENVIRONMENT_PAD = 8192
_CLIENT_FILE = Path(__file__).with_name("worker_client.py")

CLIENT_CODE = (
    f"import gc; t = gc.get_threshold(); gc.set_threshold({IMPORT_THRESHOLD}, *t[1:]); "
    "import importlib.util as u; "
    f"s = u.spec_from_file_location('tunelab_worker_client', {str(_CLIENT_FILE)!r}); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); m.main(t)"
)
"""What ``python -c`` runs in each process torchrun starts when a zygote serves the launch."""

ZYGOTE_CODE = "from tunelab.lifecycle.zygote import serve; serve()"
"""What ``python -c`` runs in the zygote."""

# What torchrun sets for each worker (and ``tunelab run`` for the zygote's clients): any other
# difference between a worker's environment and the zygote's may have mattered at import time.
_PER_WORKER_KEYS = frozenset(
    {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
     "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
     LAUNCHER_PID_ENV, SOCKET_ENV}
)  # fmt: skip
_PER_WORKER_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")
_STATUS = struct.Struct("!ci")
_HEADER = struct.Struct("!I")
_REQUEST_TIMEOUT_S = 30.0


def zygote_enabled() -> bool:
    """Whether ``tunelab run`` forks torchrun's workers from a zygote (``TUNELAB_WORKER_ZYGOTE``)."""
    return os.environ.get(ZYGOTE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class Zygote:
    """The launcher's handle on its zygote process.

    Args:
        process: The zygote.
        folder: Its private folder (the socket); removed by :meth:`close`.
    """

    def __init__(self, process: subprocess.Popen | _Forked, folder: str) -> None:
        self.process = process
        self.folder = folder

    @property
    def pid(self) -> int:
        """The zygote's pid."""
        return self.process.pid

    def close(self) -> None:
        """Kill the zygote (its workers die with it) and remove its folder."""
        if self.process.poll() is None:
            try:
                self.process.kill()
            except ProcessLookupError:
                pass
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


class _Forked:
    """The few ``Popen`` methods :class:`Zygote` uses, for a zygote this process forked."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def start_zygote(recipe: str, worker_command: list[str], debug: bool) -> Zygote | None:
    """Start the zygote that forks this launch's workers; sets ``SOCKET_ENV`` for them.

    Call it from the launcher's main thread (the zygote's parent-death signal follows the
    thread that started it), after the environment the workers inherit is complete.

    Args:
        recipe: The recipe file, whose top-level imports the zygote makes.
        worker_command: The command line torchrun will start each worker with.
        debug: Whether the zygote's own output shows (otherwise it goes to /dev/null).

    Returns:
        The zygote, or None when it could not be started (the workers then start as before).
    """
    folder = tempfile.mkdtemp(prefix="tunelab-zygote-")
    path = os.path.join(folder, "socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    template = _template.pop() if _template else None
    try:
        listener.bind(path)
        listener.listen(128)
        if template is not None:  # Forked with the imports already (fork_template).
            forked = _start_template(template, listener, recipe, debug)
            template = None
            if forked is not None:
                os.environ[SOCKET_ENV] = path
                return Zygote(forked, folder)
        # The zygote's /proc command line must have room for a worker's (see show_as).
        room = sum(len(os.fsencode(word)) + 1 for word in worker_command)
        env = dict(os.environ)
        env[_LISTENER_ENV] = str(listener.fileno())
        env[_RECIPE_ENV] = recipe
        env[_PAD_ENV] = "x" * ENVIRONMENT_PAD
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        output = None if debug else subprocess.DEVNULL
        process = subprocess.Popen(
            [sys.executable, "-u", "-c", ZYGOTE_CODE, " " * room],
            env=env,
            pass_fds=(listener.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            start_new_session=True,  # A terminal's Ctrl-C is for the launcher, not for it.
        )
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    finally:
        listener.close()  # The zygote's copy serves; a dead zygote then refuses connections.
        if template is not None:
            _discard(template)
    os.environ[SOCKET_ENV] = path
    return Zygote(process, folder)


# --- a zygote forked from a served launcher (tunelab.cli.launch_server) -------------------------------------

_template: list[tuple[int, socket.socket]] = []


def fork_template() -> bool:
    """Fork this launch's zygote now, before it knows its recipe (a served launch only).

    A ``tunelab`` command forked by the launch server (``tunelab.cli.launch_server``) has the zygote's
    imports already and is still single-threaded, untouched by the command: the child forked
    here waits for :func:`start_zygote` to send it the recipe, the listening socket and the
    workers' environment, then serves as a zygote started by ``ZYGOTE_CODE`` would, without
    importing torch again. A launch that starts no zygote drops it (:func:`discard_template`);
    it also dies with this process.

    Returns:
        True in this process; False in each worker the zygote forks, once its recipe ran (the
        caller then ends as ``ZYGOTE_CODE`` would: by returning to the interpreter).
    """
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        thresholds = _serve_template(theirs)
        run_recipe(thresholds)
        return False
    theirs.close()
    _template.append((pid, ours))
    return True


def discard_template() -> None:
    """Kill the zygote :func:`fork_template` forked, if this launch does not use it."""
    while _template:
        _discard(_template.pop())


def _discard(template: tuple[int, socket.socket]) -> None:
    pid, sock = template
    sock.close()
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass


def _start_template(
    template: tuple[int, socket.socket], listener: socket.socket, recipe: str, debug: bool
) -> _Forked | None:
    """Send the forked zygote what ``start_zygote`` would give a new one; it then imports."""
    pid, sock = template
    payload = json.dumps({"recipe": recipe, "environ": dict(os.environ), "debug": debug}).encode()
    try:
        socket.send_fds(sock, [_HEADER.pack(len(payload))], [listener.fileno()])
        sock.sendall(payload)
    except OSError:
        _discard(template)
        return None
    sock.close()
    return _Forked(pid)


def _serve_template(sock: socket.socket) -> tuple[int, ...]:
    """The forked zygote's main: wait for the launcher's request, then serve as ``serve``.

    Returns only in a forked worker: the thresholds its recipe must start with.
    """
    launcher = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    if not set_parent_death_signal() or os.getppid() != launcher:
        os._exit(0)
    try:
        header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 1)  # Waits for the launcher.
        payload = b""
        if len(header) == _HEADER.size and len(fds) == 1:
            size = _HEADER.unpack(header)[0]
            while len(payload) < size:
                chunk = sock.recv(size - len(payload))
                if not chunk:
                    break
                payload += chunk
        request = json.loads(payload)
    except (OSError, ValueError):
        os._exit(0)  # The launch starts no zygote.
    os.setsid()  # As start_new_session: a terminal's Ctrl-C is for the launcher.
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0,) if request["debug"] else (0, 1, 2):
        os.dup2(null, target)
    sock.detach()  # Its number is closed below, with what else the launcher had open.
    keep = {0, 1, 2, fds[0]}
    for name in os.listdir("/proc/self/fd"):  # What the launcher had open: not the zygote's.
        if int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:
                pass
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)  # The launcher's handlers are not the zygote's.
    environ = dict(request["environ"])
    environ.pop(LAUNCHER_PID_ENV, None)
    os.environ.clear()
    os.environ.update(environ)
    show_as(_ZYGOTE_TITLE, None)
    return _serve(socket.socket(fileno=fds[0]), request["recipe"])


_ZYGOTE_TITLE = "\0".join([sys.executable, "-u", "-c", ZYGOTE_CODE]) + "\0"


# --- the zygote process ------------------------------------------------------------------------


def serve() -> None:
    """The zygote's main (``ZYGOTE_CODE``): import, then fork workers until the launcher ends.

    Returns only in a forked worker, after its recipe ran (as ``WORKER_CODE`` would).
    """
    thresholds = gc.get_threshold()
    gc.set_threshold(IMPORT_THRESHOLD, *thresholds[1:])
    # Signals for the launch are for its workers: hold them (a blocked signal is never lost
    # to a worker that is being forked; fork clears the pending ones).
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    launcher = os.environ.pop(LAUNCHER_PID_ENV, "")
    if not set_parent_death_signal() or str(os.getppid()) != launcher:
        os._exit(0)  # No launcher, or it died before the kernel knew to tell us.
    listener = socket.socket(fileno=int(os.environ.pop(_LISTENER_ENV)))
    recipe = os.environ.pop(_RECIPE_ENV)
    os.environ.pop(_PAD_ENV, None)
    run_recipe(_serve(listener, recipe))


def _serve(listener: socket.socket, recipe: str) -> tuple[int, ...]:
    """Import for ``recipe``, then fork workers; returns in a worker, with its thresholds."""
    gc.set_threshold(IMPORT_THRESHOLD, *gc.get_threshold()[1:])
    baseline = dict(os.environ)
    _import_for(recipe)
    # What the imports did to the environment (torch's inductor sets its cache folder): a
    # worker that imported them itself would have it too.
    imported = {key: os.environ.get(key) for key in baseline.keys() | os.environ.keys()}
    imported = {key: value for key, value in imported.items() if baseline.get(key) != value}
    gc.freeze()  # What the workers share: their collections never walk it.
    flush_stdio()  # What the imports printed is the zygote's, not a worker's to print again.
    request, fds, conn, server = ForkServer(listener, baseline).serve()
    become_worker(request, fds, conn, server, imported)
    return tuple(request["thresholds"])


def _import_for(recipe: str) -> None:
    """Import what every worker of ``recipe`` imports first; a module that fails is skipped."""
    sys.path[0] = os.path.dirname(os.path.abspath(recipe))  # As run_recipe will.
    names = [
        "torch",
        "torch.distributed",
        "torch.distributed.tensor",
        "torch._dynamo",  # torch imports it on a worker's first steps.
        "torch.distributed.checkpoint",
        "tunelab.lifecycle.entry",
        "tunelab.training",
        "tunelab.checkpoint.client",
        "tunelab.checkpoint.export",
        *recipe_imports(recipe),
    ]
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - the worker meets it itself, as before
            continue


def recipe_imports(recipe: str) -> list[str]:
    """The absolute module names a recipe file imports at its top level (``ast``).

    ``from package import name`` yields ``package`` and ``package.name`` (it may be a
    submodule). Imports inside functions, relative imports and unparsable files are skipped.

    Args:
        recipe: The recipe file's path.

    Returns:
        The module names, in file order.
    """
    try:
        tree = ast.parse(Path(recipe).read_bytes(), filename=recipe)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    statements = list(tree.body)
    while statements:
        node = statements.pop(0)
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Try):
            statements[:0] = node.body
    return names


def fork_refusal(request: dict, baseline: dict[str, str]) -> str | None:
    """Why this zygote must not fork the worker ``request`` asks for, or None."""
    threads = threading.active_count()
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:
        tasks = threads
    if threads != 1 or tasks != 1:
        return f"the zygote runs {max(threads, tasks)} threads"
    if not hasattr(os, "pidfd_open"):
        return "no pidfd_open"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and (cuda.is_initialized() or cuda._is_in_bad_fork()):
        return "the zygote initialized CUDA"  # A forked child could not use it.
    ours = (sys.executable, sys.version, list(sys.flags), sys.warnoptions)
    theirs = (request["executable"], request["version"], request["flags"], request["warnoptions"])
    xoptions = {str(k): str(v) for k, v in sys._xoptions.items()}
    if ours != tuple(theirs) or xoptions != request["xoptions"]:
        return "the worker's interpreter or its flags differ from the zygote's"
    environ = request["environ"]
    for key in sorted(baseline.keys() | environ.keys()):
        if key in _PER_WORKER_KEYS or key.startswith(_PER_WORKER_PREFIXES):
            continue
        if baseline.get(key) != environ.get(key):
            return f"the worker's environment differs from the zygote's in {key}"
    limits = resource_limits()
    for name, (_, hard) in request.get("rlimits", {}).items():
        ours = limits.get(name)
        if ours is None or _above(hard, ours[1]):  # Only a privileged process may raise it.
            return f"the worker's resource limit {name} is above the zygote's"
    return None


def _above(limit: int, ceiling: int) -> bool:
    infinity = resource.RLIM_INFINITY
    return ceiling != infinity and (limit == infinity or limit > ceiling)


def _set_resource_limits(limits: dict[str, list[int]]) -> None:
    for name, (soft, hard) in limits.items():
        which = getattr(resource, name)
        if resource.getrlimit(which) != (soft, hard):
            resource.setrlimit(which, (soft, hard))  # `ulimit -f`, `prlimit`, a preexec_fn.


class ForkServer:
    """The zygote's loop: fork a worker per request, report each worker's end to its client."""

    def __init__(
        self,
        listener: socket.socket,
        baseline: dict[str, str],
        refusal: Callable[[dict, dict[str, str]], str | None] | None = None,
    ) -> None:
        self.listener = listener
        self.zygote_pid = os.getpid()
        self.baseline = baseline
        self.refusal = refusal or fork_refusal
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, ("accept", 0))
        self.clients: dict[int, socket.socket] = {}  # worker pid -> its client's socket
        self.pidfds: dict[int, int] = {}  # worker pid -> its pidfd

    def serve(self) -> tuple[dict, list[int], socket.socket, ForkServer]:
        """Serve until a fork; returns (in the forked child only) what it must become."""
        while True:
            for key, _ in self.selector.select():
                kind, pid = key.data
                if kind == "accept":
                    try:
                        conn, _ = self.listener.accept()
                    except OSError:
                        continue
                    child = self._start(conn)
                    if child is not None:
                        return (*child, self)
                elif kind == "client":  # The client closed (it died): so does its worker.
                    self.selector.unregister(key.fileobj)
                    _kill_group(pid)
                else:  # The worker ended.
                    self._report(pid)

    def _start(self, conn: socket.socket) -> tuple[dict, list[int], socket.socket] | None:
        fds: list[int] = []
        forked = False
        try:
            conn.settimeout(_REQUEST_TIMEOUT_S)
            header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
            if len(header) != _HEADER.size or len(fds) != 3:
                raise ValueError("bad request")
            payload = b""
            size = _HEADER.unpack(header)[0]
            while len(payload) < size:
                chunk = conn.recv(size - len(payload))
                if not chunk:
                    raise ValueError("short request")
                payload += chunk
            request = json.loads(payload)
            refusal = self.refusal(request, self.baseline)
            if refusal is not None:
                conn.sendall(b"N" + refusal.encode())
                raise ValueError(refusal)
            conn.sendall(b"R")
            if conn.recv(1) != b"G":
                raise ValueError("the client gave up")
            pid = os.fork()
            if pid == 0:
                forked = True
                return request, fds, conn
            try:
                pidfd = os.pidfd_open(pid)
                conn.settimeout(None)
                conn.sendall(_STATUS.pack(b"P", pid))
            except OSError:
                _kill_group(pid)  # Its client is gone, or it could not be watched.
                os.waitpid(pid, 0)
                raise
        except (OSError, ValueError):
            conn.close()
            return None
        finally:
            if not forked:  # The worker's copies are its stdin, stdout and stderr.
                for fd in fds:
                    os.close(fd)
        self.clients[pid] = conn
        self.pidfds[pid] = pidfd
        self.selector.register(conn, selectors.EVENT_READ, ("client", pid))
        self.selector.register(pidfd, selectors.EVENT_READ, ("exit", pid))
        return None

    def _report(self, pid: int) -> None:
        _, status = os.waitpid(pid, 0)
        pidfd = self.pidfds.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        conn = self.clients.pop(pid)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass  # Its client is gone already.
        try:
            conn.sendall(_STATUS.pack(b"X", os.waitstatus_to_exitcode(status)))
        except OSError:
            pass
        conn.close()

    def close_in_child(self, keep: socket.socket) -> None:
        """In a forked worker: close what serves the other workers."""
        for key in list(self.selector.get_map().values()):
            obj = key.fileobj
            if obj is keep:
                continue
            if isinstance(obj, int):
                os.close(obj)
            else:
                obj.close()
        self.selector.close()
        for conn in self.clients.values():
            conn.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # The worker and its helper processes.
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)  # It has not made its own group yet.
        except OSError:
            pass


def become_worker(
    request: dict,
    fds: list[int],
    conn: socket.socket,
    server: ForkServer,
    imported: dict[str, str | None],
    launch: bool = False,
) -> None:
    """In the forked child: take on the client's process state, as a fresh worker has it.

    ``imported`` is what the zygote's imports changed in its environment (None: removed).
    ``launch``: the child is a ``tunelab`` command forked by the launch server
    (``tunelab.cli.launch_server``), not a worker: it keeps the signals its client's process ignored,
    and neither dies with nor shows itself as its client (the client stays the command).
    """
    zygote = os.getppid()
    set_parent_death_signal()
    if os.getppid() != server.zygote_pid:
        os._exit(128 + signal.SIGKILL)  # The zygote died before the kernel knew to tell us.
    os.setsid()  # Its own session and group, as torchrun starts a worker.
    server.close_in_child(conn)
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    ignored = set(request.get("ignored", ())) if launch else set()
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, at start.
    signal.pthread_sigmask(signal.SIG_SETMASK, request["mask"])
    os.umask(request["umask"])
    _set_resource_limits(request.get("rlimits", {}))
    if request["affinity"] is not None and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, request["affinity"])  # torchrun's NUMA binding, taskset.
        except OSError:
            pass
    if request["priority"] is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, request["priority"])  # `nice tunelab run ...`
        except OSError:
            pass
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["environ"])
    for key, value in imported.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if not launch:
        os.environ[LAUNCHER_PID_ENV] = str(zygote)  # exit_with_launcher: die with the zygote.
        show_as(request["cmdline"], request["proc_environ"])
    unbuffered = request.get("unbuffered")
    if launch or (unbuffered is not None and unbuffered != _unbuffered()):
        fresh_stdio(bool(unbuffered))  # A terminal's line buffering; `python -u`.
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # A fresh process seeds its global generator from the OS.
    sys.argv = list(request["argv"])
    if request["orig_argv"] is not None:
        sys.orig_argv = list(request["orig_argv"])


def flush_stdio() -> None:
    """Flush stdout and stderr, so what this process printed is not printed again by a fork."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def _unbuffered() -> bool:
    """Whether this process's stdio is unbuffered (``python -u``, ``PYTHONUNBUFFERED``)."""
    return bool(getattr(sys.stdout, "write_through", False))


def fresh_stdio(unbuffered: bool) -> None:
    """Make ``sys.stdin``, ``stdout`` and ``stderr`` what Python makes at start for fds 0-2.

    As CPython's ``create_stdio``: unbuffered (``-u``) streams are written through, and the
    writers' buffers are raw files; buffered ones are line-buffered on a terminal (stderr
    always). The old objects are flushed
    left as they are (they do not own their descriptors; the process that forked this one
    flushed them before it forked).

    Args:
        unbuffered: Whether the process is to have unbuffered stdio (``python -u``).
    """
    for fd, name, mode in ((0, "stdin", "rb"), (1, "stdout", "wb"), (2, "stderr", "wb")):
        old = getattr(sys, name)
        if old is None:
            continue
        raw_unbuffered = unbuffered and fd != 0
        try:
            buffer = open(fd, mode, buffering=0 if raw_unbuffered else -1, closefd=False)
        except OSError:
            continue  # Closed: Python leaves it None at start; keep what there is.
        line_buffering = not unbuffered and (fd == 2 or os.isatty(fd))
        stream = io.TextIOWrapper(
            buffer,
            encoding=old.encoding,
            errors=old.errors,
            newline="\n",
            line_buffering=line_buffering,
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def show_as(cmdline: str | None, environ: str | None) -> None:
    """Make ``/proc/self/cmdline`` and ``environ`` show the client's (when they fit).

    The zygote's areas were padded for it; the C environment no longer points into the
    environment area (``os.environ`` was cleared and refilled before this).
    """
    try:
        with open("/proc/self/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
        arg_start, arg_end, env_start, env_end = (int(f) for f in fields[45:49])
    except (OSError, ValueError, IndexError):
        return
    for text, start, end in ((cmdline, arg_start, arg_end), (environ, env_start, env_end)):
        if text is None or start >= end:
            continue
        data = text.encode("latin-1")
        if len(data) <= end - start:
            ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)
