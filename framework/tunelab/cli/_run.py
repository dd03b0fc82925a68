"""``tunelab run``: validate, then launch a recipe on 1 process or through torchrun."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tunelab.cli._check import check_config, load_recipe_config
from tunelab.cli._discovery import builtin_recipes
from tunelab.cli._launcher_signals import LauncherStop
from tunelab.errors import shorten
from tunelab.lifecycle import (
    LAUNCHER_PID_ENV,
    STOP_SIGNALS,
    check_output_dir_free,
    stop_signals_blocked,
)
from tunelab.lifecycle.collective_timeout import PEER_CLOSED_KEY, CollectiveTimeout
from tunelab.lifecycle.entry import ERROR_FILE_ENV, _recipe_parser
from tunelab.lifecycle.preemption import REPORTED_BY_LAUNCHER_ENV, STOP_LINE_FILE_ENV, signal_name
from tunelab.lifecycle.worker_start import WORKER_CODE, worker_arguments
from tunelab.lifecycle.zygote import (
    CLIENT_CODE,
    Zygote,
    discard_template,
    start_zygote,
    zygote_enabled,
)

USAGE = """\
usage: tunelab run [TORCHRUN OPTIONS] RECIPE --config CONFIG [OVERRIDE ...]

Validate CONFIG against RECIPE's settings, then run it.

  RECIPE      a built-in recipe name (`tunelab ls`) or a path to a .py file
  CONFIG      a built-in config name or a path to a YAML file
  OVERRIDE    key=value, a.b.c=value or ~key

Without torchrun options the recipe runs as one process (RANK=0, WORLD_SIZE=1). With them
(--nproc_per_node 2, --nnodes, --rdzv-endpoint, --master-port, ...: see `torchrun --help`) it
is launched through torch.distributed.run; a single-node launch without a rendezvous endpoint
or master port gets a free port of its own.

SIGTERM or SIGINT (Ctrl-C) stops the run at the end of a step with a committed checkpoint and
exit code 128 + signal (143, 130); a second one stops it at once. The workers die with this
command. A worker killed by any other signal (SIGKILL from the out-of-memory killer, SIGSEGV)
ends the run with 128 + that signal (137, 139, ...) and a line naming its rank and signal.
"""

# torchrun's loud INFO/WARNING lines (rendezvous banners, "failed (exitcode...)") repeat what
# the recipe and this command already say; --debug brings them back.
_ELASTIC_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.run",
    "torch.distributed.launcher",
)
# The signals torchrun's launcher handles (its default --signals-to-handle; Windows has two).
_TORCHRUN_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)
# How long torchrun waits for workers to stop after forwarding a signal before it SIGKILLs
# them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT; torch's default of 30 s is short for a real model's
# final checkpoint). The environment variable or --shutdown-timeout wins.
SHUTDOWN_TIMEOUT_S = 300
# How long torchrun waits for the other workers after one failed before it SIGKILLs them:
# torch's fixed default (PContext.close), whatever TORCH_ELASTIC_SHUTDOWN_TIMEOUT says (that
# one applies after a signal to the launcher).
TORCHRUN_CLOSE_WAIT_S = 30
# torch's switch for the rendezvous store that workers share across restarts (see below).
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# A recipe that exits with these stopped on a signal and printed its own line.
STOPPED_EXIT_CODES = frozenset(128 + signum for signum in STOP_SIGNALS)
"""Exit codes of a run stopped by SIGTERM/SIGINT (143, 130): the last step is committed."""
# Signals a launcher sends its workers to stop them (torchrun's --signals-to-handle): a worker
# killed by one of these was stopped, not the cause. Any other signal killed it on its own.
_LAUNCHER_SIGNALS = frozenset((*STOP_SIGNALS, *_TORCHRUN_SIGNALS))


class _StoppedBeforeStart(BaseException):
    """A stop signal before any worker exists (while validating, or torchrun's rendezvous)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_before_start(signum: int, frame: object) -> None:
    raise _StoppedBeforeStart(signum)


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the ``run`` subcommand; its arguments are parsed by ``run`` itself."""
    parser = subparsers.add_parser(
        "run",
        add_help=False,
        help="validate a config and run a recipe (1 process, or N through torchrun)",
        usage="tunelab run [TORCHRUN OPTIONS] RECIPE --config CONFIG [OVERRIDE ...]",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_one_process(recipe: Path, child_args: list[str], debug: bool) -> int:
    discard_template()  # A served launch's zygote-to-be (launch_server): no zygote here.
    # The same environment torchrun gives a 1-process job, so the recipe takes one code path.
    env = dict(
        os.environ,
        RANK="0",
        LOCAL_RANK="0",
        GROUP_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    env[LAUNCHER_PID_ENV] = str(os.getpid())  # The child dies with this process.
    env[REPORTED_BY_LAUNCHER_ENV] = "1"
    if debug:
        env["TUNELAB_DEBUG"] = "1"
    # As under torchrun: the child records its one-line error there and this process prints it.
    error_file = Path(tempfile.mkdtemp(prefix="tunelab-run-")) / "error.json"
    env[ERROR_FILE_ENV] = str(error_file)
    stop_line = error_file.parent / "stop_line"
    env[STOP_LINE_FILE_ENV] = str(stop_line)
    # The child starts with the stop signals blocked (pending until its handlers are in), and
    # this process says what a stop does and forwards the signal (as torchrun does), then
    # keeps waiting: the child finishes its step, saves and exits with 128 + signal. Signals
    # that came during the start-up are delivered when the block ends, to these handlers. A
    # second signal kills the child at once.
    with stop_signals_blocked():
        child = subprocess.Popen(
            [sys.executable, *worker_arguments(str(recipe), child_args)], env=env
        )
        stop = LauncherStop(child.send_signal, lambda: [child.pid], [error_file.parent])
        previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        code = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    try:
        recorded = _recorded_line(json.loads(error_file.read_text()))
    except (OSError, ValueError):
        recorded = ""
    if code in STOPPED_EXIT_CODES:
        _print_stop_line(stop_line)
    shutil.rmtree(error_file.parent, ignore_errors=True)
    if code != 0 and code not in STOPPED_EXIT_CODES:
        line = recorded or f"recipe {recipe.stem} failed ({_exit_reason(code)})"
        print(f"tunelab: error: {line}", file=sys.stderr)
        return _exit_status(code)
    return code


def _exit_reason(code: int) -> str:
    """How a worker ended, from its exit code (negative: killed by that signal)."""
    if code > 0:
        return f"exit code {code}"
    try:
        name = signal_name(-code)
    except ValueError:
        return f"signal {-code}"
    why = " (out of memory? the kernel's OOM killer sends it)" if -code == signal.SIGKILL else ""
    return f"killed by {name}, signal {-code}{why}"


def _exit_status(code: int) -> int:
    """This command's exit status for a worker's failing exit code (128 + signal if killed)."""
    return code if code > 0 else 128 - code


# The zygotes of this process's torchrun launches: children, but no workers (see _own_children).
_zygote_pids: set[int] = set()


def _own_children() -> list[int]:
    """The live worker processes of this process (Linux ``/proc``; none found elsewhere).

    Its children, less the zygote (which holds stop signals for the workers it forks and
    dies with this process).
    """
    pids: list[int] = []
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        try:
            pids += [int(pid) for pid in children.read_text().split()]
        except (OSError, ValueError):
            continue
    return [pid for pid in pids if pid not in _zygote_pids]


def _stop_workers_torchrun_missed(signum: int) -> None:
    """Forward a stop signal to workers torchrun had spawned but not yet recorded, and wait.

    torchrun signals the workers of its process context; a signal that lands while it is
    still spawning them (after the spawn, before it records them) leaves them running, and
    they would end silently with this process instead of saying why. Workers start with the
    stop signals blocked, so the forwarded one waits for their handlers: rank 0 prints the
    stop line. Waits up to the shutdown timeout, then kills what is left.
    """
    children = _own_children()
    _signal_children(signum)
    timeout_s = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S))
    deadline = time.monotonic() + timeout_s
    for pid in children:
        while True:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break  # Already reaped.
            if done or time.monotonic() > deadline:
                if not done:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.05)


def _first_failure(failures: dict) -> tuple[int, object]:
    """The rank whose failure stopped a torchrun job, and its ``ProcessFailure``.

    A worker killed by a signal no launcher sends (SIGKILL from the out-of-memory killer,
    SIGSEGV, SIGABRT) died on its own: it is the cause, and the errors its peers then record
    ("Connection reset by peer") are its consequence. The one exception is a worker torchrun
    itself SIGKILLed because it still ran :data:`TORCHRUN_CLOSE_WAIT_S` after another rank
    failed (a hung rank, whose peer's collective timed out).

    Otherwise torchrun stops the other workers once one fails: they come back killed by a
    signal, or, when their stop handler ran first, with exit code 128 + signal, and with no
    recorded line. Those are never the cause while a rank failed on its own; a rank that did
    record its line failed on its own, even when torchrun's signal then ended its exit. Nor is
    a rank whose line says a peer's connection closed under it (``PEER_CLOSED_KEY``): the
    peer's exit caused it. Among the rest, the earliest wins (torchrun's timestamps are whole
    seconds, so ties go to the lowest rank).
    """

    def died_on_its_own(failure: object) -> bool:
        if failure.exitcode >= 0 or -failure.exitcode in _LAUNCHER_SIGNALS:
            return False
        if -failure.exitcode != signal.SIGKILL:
            return True
        # torchrun stamps a worker it SIGKILLed when it reaps it, after the whole wait; one
        # the OOM killer took is stamped when torchrun finds it, before it stops the others.
        others = [f.timestamp for f in failures.values() if f is not failure]
        return not (others and failure.timestamp - min(others) >= TORCHRUN_CLOSE_WAIT_S - 1)

    def stopped_by_launcher(failure: object) -> bool:
        return not _recorded_line(failure.error_file_data) and (
            failure.exitcode <= 0 or failure.exitcode in STOPPED_EXIT_CODES
        )

    def closed_under_it(failure: object) -> bool:
        data = failure.error_file_data
        return isinstance(data, dict) and data.get(PEER_CLOSED_KEY) is True

    return min(
        failures.items(),
        key=lambda item: (
            not died_on_its_own(item[1]),
            stopped_by_launcher(item[1]),
            closed_under_it(item[1]),
            item[1].timestamp,
            item[0],
        ),
    )


def _describe_failure(recipe: str, rank: int, failure: object, failures: dict | None = None) -> str:
    """One line for a failed torchrun job: the failing rank's own recorded line.

    When that rank timed out in a collective, the line names the ranks that did not arrive:
    among ``failures`` (every rank's), those that did not time out in a collective themselves
    (torchrun stopped them, still elsewhere, after this rank failed).
    """
    message = _recorded_line(failure.error_file_data)
    if message and failure.exitcode != 0:
        timeout = CollectiveTimeout.from_record(failure.error_file_data)
        if timeout is not None and failures:
            missing = sorted(
                other
                for other, record in failures.items()
                if other != rank and CollectiveTimeout.from_record(record.error_file_data) is None
            )
            return shorten(timeout.line(missing or None))
        return message
    return f"recipe {recipe} failed on rank {rank} ({_exit_reason(failure.exitcode)})"


def _recorded_line(data: object) -> str:
    """The line a worker recorded in its error file (``recipe_main``), or ''."""
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    # torchrun's placeholder for a worker that recorded nothing.
    return message if isinstance(message, str) and message != "<NONE>" else ""


def _run_torchrun(
    torchrun_args: list[str], recipe: Path, child_args: list[str], debug: bool
) -> int:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "tunelab run"
    launch = parser.parse_args([*torchrun_args, str(recipe), *child_args])
    defaults = parser.parse_args(["recipe.py"])
    ours = not (launch.no_python or launch.module or launch.run_path)
    if ours:
        # Each worker is `python -u -c WORKER_CODE RECIPE ARGS` (worker_start: the recipe runs
        # as __main__, its imports with fewer garbage collections) where torchrun would start
        # `python -u RECIPE ARGS`.
        launch.no_python = True
        launch.training_script_args = [
            "-u", *worker_arguments(launch.training_script, launch.training_script_args)
        ]  # fmt: skip
        launch.training_script = os.getenv("PYTHON_EXEC", sys.executable)
    rendezvous_keys = ("rdzv_endpoint", "rdzv_backend", "master_addr", "master_port", "nnodes")
    if not any(getattr(launch, key) != getattr(defaults, key) for key in rendezvous_keys) and not (
        os.environ.keys() & {"PET_RDZV_ENDPOINT", "PET_MASTER_PORT", "PET_MASTER_ADDR"}
    ):
        # A rendezvous on a free local port, so parallel runs on one machine never collide.
        launch.standalone = True
    if debug:
        os.environ["TUNELAB_DEBUG"] = "1"
    else:
        # torch's elastic modules give their loggers levels of their own (get_logger), so
        # the parents' level alone does not silence them.
        for name in [*_ELASTIC_LOGGERS, *logging.root.manager.loggerDict]:
            if name.startswith(_ELASTIC_LOGGERS):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    # torchrun would set this with a boxed warning when several processes share a node.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    # The restarted group's workers must not find the dead group's addresses (torch 2.13):
    # by default the c10d rendezvous shares its store with the workers across restarts, with
    # no per-round prefix, so a restart connected to the dead workers' ports ("connectFullMesh
    # ... Connection refused") and hung. Opting out gives each round a fresh worker store.
    os.environ.setdefault(SHARE_STORE_ENV, "1")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # Workers die with this process.
    os.environ[REPORTED_BY_LAUNCHER_ENV] = "1"  # This process prints the workers' errors.
    if launch.nnodes in ("1", "1:1"):
        # On several nodes every node's launcher would check, and a node joining late would
        # find the lock taken by this very run: there, rank 0's own lock is the check.
        _check_output_dir(child_args)
    # Rank 0's "stopped ... before a checkpoint was committed" line comes here, to be printed
    # only when the run was really stopped, not when torchrun stopped it after a rank died.
    stop_line = Path(tempfile.mkdtemp(prefix="tunelab-stop-")) / "line"
    os.environ[STOP_LINE_FILE_ENV] = str(stop_line)
    zygote = None
    try:
        if ours and zygote_enabled():
            zygote = _start_zygote(launch, recipe, debug)
        discard_template()  # A served launch's zygote-to-be (launch_server), if unused.
        return _launch(launch, recipe, stop_line)
    finally:
        if zygote is not None:
            zygote.close()
            _zygote_pids.discard(zygote.pid)
        shutil.rmtree(stop_line.parent, ignore_errors=True)


def _start_zygote(launch: argparse.Namespace, recipe: Path, debug: bool) -> Zygote | None:
    """Start the zygote that forks this launch's workers (``lifecycle.zygote``), if it can.

    Each worker torchrun starts is then ``python -u -c CLIENT_CODE RECIPE ARGS`` instead of
    ``python -u -c WORKER_CODE RECIPE ARGS``; a client the zygote cannot serve runs the recipe
    itself, as the latter does.
    """
    arguments = launch.training_script_args
    code = arguments.index(WORKER_CODE)
    client = [*arguments[:code], CLIENT_CODE, *arguments[code + 1 :]]
    zygote = start_zygote(str(recipe), [launch.training_script, *client], debug)
    if zygote is not None:
        launch.training_script_args = client
        _zygote_pids.add(zygote.pid)
    return zygote


def _print_stop_line(stop_line: Path) -> None:
    with contextlib.suppress(OSError):
        print(stop_line.read_text(), flush=True)


def _calling_method_name(depth: int = 2) -> str:
    # As torch's dynamic_rendezvous.get_method_name, which it replaces: the name of the function
    # ``depth`` frames up (0: this one), for the rendezvous event log. torch's calls
    # ``inspect.stack()`` twice, which reads the source line of every frame and maps each frame
    # to its module over sys.modules: 2-3 ms a call, ~0.15 CPU-s of a 2-process launch.
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def _launch(launch: argparse.Namespace, recipe: Path, stop_line: Path) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.run import run

    if hasattr(dynamic_rendezvous, "get_method_name"):  # The same names, without inspect.
        dynamic_rendezvous.get_method_name = _calling_method_name

    handlers = {signum: signal.getsignal(signum) for signum in _TORCHRUN_SIGNALS}
    # SIGTERM and SIGINT are this process's (LauncherStop): the first says what a stop does and
    # raises torchrun's SignalException, whose handling forwards it to every worker and waits
    # for them; a second kills them at once. torchrun keeps the other signals it handles.
    requested = [name.strip() for name in launch.signals_to_handle.split(",")]
    ours = [signum for signum in STOP_SIGNALS if signum.name in requested]
    launch.signals_to_handle = ",".join(
        name for name in requested if name not in {signum.name for signum in ours}
    )
    in_torchrun = True

    def on_first(signum: int) -> None:
        if in_torchrun:
            _raise_signal_exception(signum)
        _signal_children(signum)  # After torchrun: the workers it missed (see below).

    stop = LauncherStop(on_first, _own_children, [stop_line.parent])
    try:
        for signum in ours:
            signal.signal(signum, stop)
        try:
            # torchrun spawns the workers from this thread: they inherit the block, so a
            # stop signal during their start-up waits for their handlers. This process keeps
            # receiving signals through a helper thread; the handlers run in this thread.
            with stop_signals_blocked(keep_receiving=True):
                run(launch)
        except SignalException as err:
            # The workers stopped (rank 0 printed the stop line, or left it here). A second
            # stop signal (here too) kills them and exits at once (LauncherStop).
            in_torchrun = False
            _stop_workers_torchrun_missed(int(err.sigval))
            _print_stop_line(stop_line)
            return 128 + int(err.sigval)
        except ChildFailedError as err:
            codes = [f.exitcode for _, f in sorted(err.failures.items()) if 0 < f.exitcode < 256]
            if codes and all(
                f.exitcode in STOPPED_EXIT_CODES and not _recorded_line(f.error_file_data)
                for f in err.failures.values()
            ):
                _print_stop_line(stop_line)
                return codes[0]  # Signalled workers (not this process) stopped; rank 0 said so.
            rank, failure = _first_failure(err.failures)
            line = _describe_failure(recipe.stem, rank, failure, err.failures)
            print(f"tunelab: error: {line}", file=sys.stderr)
            # A rank that recorded its own failure failed (1), whatever signal ended its exit.
            recorded = _recorded_line(failure.error_file_data)
            return 1 if recorded and failure.exitcode < 0 else _exit_status(failure.exitcode)
        return 0
    finally:
        for signum, handler in handlers.items():  # torchrun leaves its handlers in place.
            signal.signal(signum, handler)


def _signal_children(signum: int) -> None:
    for pid in _own_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _raise_signal_exception(signum: int) -> None:
    """Hand a stop signal to torchrun as its own handler would: it shuts the workers down."""
    from torch.distributed.elastic.multiprocessing import SignalException

    sigval = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def _check_output_dir(child_args: list[str]) -> None:
    """Stop before any process starts when another run holds the config's output_dir."""
    config, overrides = child_args[1], child_args[2:]
    output_dir = load_recipe_config(config, overrides)[0].get("output_dir")
    if isinstance(output_dir, str) and output_dir:
        check_output_dir_free(output_dir)


def run_command(argv: list[str], debug: bool) -> int:
    """Run ``tunelab run`` with its raw arguments.

    Args:
        argv: Everything after ``run``.
        debug: Whether tracebacks and torchrun's logs should show.

    Returns:
        The exit code: the recipe's (non-zero on failure; 128 + signal when a SIGTERM or
        SIGINT stopped it).

    Raises:
        TunelabError: If the recipe or config is missing, the config does not validate, or
            another run holds the config's output_dir.
    """
    previous = {signum: signal.signal(signum, _stop_before_start) for signum in STOP_SIGNALS}
    try:
        return _run_command(argv, debug)
    except _StoppedBeforeStart as stop:
        print(f"stopped by {signal_name(stop.signum)} before training started", flush=True)
        return 128 + stop.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run_command(argv: list[str], debug: bool) -> int:
    if "--debug" in argv:
        argv = [arg for arg in argv if arg != "--debug"]
        debug = True
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    checked = None
    if argv[0].startswith("-"):
        # A config error is said before torch is imported (seconds) when the recipe is plain to
        # see; torch's own parser then splits the torchrun options for real.
        guess = _guess_split(argv)
        if guess is not None:
            checked = (guess, _check_recipe_args(*guess))
        _import_torchrun()
        torchrun_args, recipe, recipe_args = _split_torchrun(argv)
    else:  # No torchrun options: no need to import torch here.
        torchrun_args, recipe, recipe_args = [], argv[0], argv[1:]
    if checked is not None and checked[0] == (recipe, recipe_args):
        recipe_cli, (config_path, recipe_path) = checked[1]
    else:
        recipe_cli, (config_path, recipe_path) = _check_recipe_args(recipe, recipe_args)
    child_args = ["--config", str(config_path.resolve()), *recipe_cli.overrides]
    if torchrun_args:
        return _run_torchrun(torchrun_args, recipe_path.resolve(), child_args, debug)
    _check_output_dir(child_args)
    return _run_one_process(recipe_path.resolve(), child_args, debug)


def _check_recipe_args(
    recipe: str, recipe_args: list[str]
) -> tuple[argparse.Namespace, tuple[Path, Path]]:
    """Parse ``--config CONFIG [overrides]`` and check the config against the recipe."""
    recipe_parser = _recipe_parser()
    recipe_parser.prog = f"tunelab run {recipe}"
    recipe_cli = recipe_parser.parse_intermixed_args(recipe_args)
    return recipe_cli, check_config(recipe_cli.config, recipe_cli.overrides, recipe)


# torchrun's options that take no value (torch.distributed.run's parser; a test compares).
TORCHRUN_FLAGS = frozenset(
    {"-h", "--help", "--standalone", "-m", "--module", "--no-python", "--no_python",
     "--run-path", "--run_path", "--virtual-local-rank", "--virtual_local_rank"}
)  # fmt: skip


def _guess_split(argv: list[str]) -> tuple[str, list[str]] | None:
    """The recipe and its arguments after torchrun options, found without importing torch.

    Every option takes one value unless it is one of ``TORCHRUN_FLAGS`` or written
    ``--name=value``. The guess counts only when the word it finds names a recipe (built-in
    or an existing file), so an abbreviated flag can make it miss, never mislead: the caller
    still splits with torch's parser and checks again if the two differ.
    """
    position = 0
    while position < len(argv) and argv[position].startswith("-"):
        option = argv[position]
        position += 1 if option in TORCHRUN_FLAGS or "=" in option else 2
    if position >= len(argv):
        return None
    recipe = argv[position]
    if recipe not in builtin_recipes() and not Path(recipe).expanduser().is_file():
        return None
    return recipe, argv[position + 1 :]


def _import_torchrun() -> None:
    """Import torch's launcher with the garbage collector paused, and freeze what it made.

    The import makes some 170,000 objects that live as long as this process; the
    collections it triggers while they pile up walk them again and again (0.15-0.2 of its ~1.2
    CPU-seconds, measured), and so would the launcher's own collections during the run. Done
    only where torch is not imported yet (this command's process, not a test calling it).
    """
    if "torch" in sys.modules:
        return
    gc.collect()  # Nothing that is garbage now gets frozen (the heap is still small).
    enabled = gc.isenabled()
    gc.disable()
    try:
        import torch.distributed.run  # noqa: F401
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def _split_torchrun(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """Split ``[torchrun options] RECIPE [recipe args]`` into its three parts."""
    # torch's own parser knows which options take values, so it finds where the recipe starts.
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "tunelab run"
    parser.usage = USAGE.splitlines()[0].removeprefix("usage: ")
    for action in parser._actions:  # Name torch's positionals as this command does.
        if action.dest == "training_script":
            action.metavar = "RECIPE"
        elif action.dest == "training_script_args":
            action.metavar = "--config CONFIG"
    launch = parser.parse_args(argv)
    split = len(argv) - len(launch.training_script_args) - 1
    assert argv[split] == launch.training_script
    return argv[:split], launch.training_script, launch.training_script_args
