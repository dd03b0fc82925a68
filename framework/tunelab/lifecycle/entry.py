"""A recipe process's start and end: ``recipe_main``.

It parses ``recipe.py --config PATH [overrides]``, validates the settings, arms the stop
handlers and the launcher watch, runs the recipe, and turns its failure into one line and an
exit code.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

from omegaconf import DictConfig

from tunelab.config._load import load_config
from tunelab.config._validate import parse_args
from tunelab.errors import TunelabError, first_line, shorten
from tunelab.lifecycle.collective_timeout import (
    PEER_CLOSED_KEY,
    RECORD_KEY,
    CollectiveTimeout,
    describe_timeout,
    peer_closed,
)
from tunelab.lifecycle.parent_death import exit_with_launcher
from tunelab.lifecycle.preemption import (
    REPORTED_BY_LAUNCHER_ENV,
    STOP_LINE_FILE_ENV,
    TrainingStopped,
    install_stop_handlers,
    signal_name,
    signal_received,
)
from tunelab.lifecycle.restarts import restart_follows
from tunelab.lifecycle.run_folder import RunFolder
from tunelab.lifecycle.worker_start import restore_collector

T = TypeVar("T")


def _recipe_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        usage="%(prog)s --config CONFIG [key=value | ~key ...] [--debug]",
        description="Run a tunelab recipe. Usually launched by `tunelab run`.",
    )
    parser.add_argument("--config", required=True, help="built-in config name or YAML path")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of tunelab errors")
    parser.add_argument("overrides", nargs="*", help="key=value, a.b.c=value or ~key")
    return parser


def parse_recipe_cli(argv: list[str] | None = None, args_cls: type | None = None) -> DictConfig:
    """Parse a recipe's command line and load its config.

    Args:
        argv: The arguments (``sys.argv[1:]`` when None): ``--config CONFIG [overrides]``.
        args_cls: The recipe's settings, whose text settings take override values literally
            (None: those of the recipe the config's ``recipe`` key names).

    Returns:
        The loaded config with the overrides applied.

    Raises:
        ConfigError: If the config cannot be loaded or an override is bad.
    """
    namespace = _recipe_parser().parse_intermixed_args(argv)
    return load_config(namespace.config, namespace.overrides, args_cls)


def debug_enabled(argv: list[str] | None = None) -> bool:
    """Return whether tracebacks of tunelab errors should show (``--debug``/``TUNELAB_DEBUG=1``)."""
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("TUNELAB_DEBUG", "") not in ("", "0")


ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""Where a worker records its one-line error for the launcher (torchrun's ``record`` format).

``tunelab run`` sets it for its single process too, so in both paths the launcher, and only
the launcher, prints the line: once, after the workers are gone, never glued to a progress bar.
"""


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _write_rank_log(output_dir: object, text: str) -> str | None:
    """Append ``text`` to ``{output_dir}/logs/rank_{RANK}.log``; return its path, or None."""
    if not isinstance(output_dir, str) or not output_dir:
        return None
    path = str(RunFolder(output_dir).rank_log(_rank()))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a", encoding="utf-8") as file:
            file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}\n{text}\n")
    except OSError:
        return None
    return path


def _report_failure(err: BaseException, args: object, debug: bool) -> None:
    """Say what failed in one line and exit 1; the traceback goes to the rank's log file.

    A ``TunelabError`` (bad input) is its message; anything else is
    ``rank N: <ExceptionType>: <first line> (traceback in .../logs/rank_N.log)``. Each line is
    shortened to about 200 characters (``errors.shorten``); the log file keeps it whole.
    """
    stack = traceback.format_exc()
    log_path = _write_rank_log(getattr(args, "output_dir", None), stack)
    timeout = None if isinstance(err, TunelabError) else _collective_timeout(err, log_path)
    if isinstance(err, TunelabError):
        line = str(err)
    elif timeout is not None:
        # Not the transport's words ("Timed out waiting 5000ms for send operation"): which
        # collective, where this rank called it, and which rank it waited for.
        line = timeout.line()
    else:
        first = first_line(err)
        line = f"rank {_rank()}: {type(err).__name__}: {first}"
        line += f" (traceback in {log_path})" if log_path else ""
    # The one place a worker's error line is made: every printer shows it as recorded here.
    line = shorten(line)
    _close_progress_bars()
    if debug:
        traceback.print_exc()
    record_path = os.environ.get(ERROR_FILE_ENV)
    recorded = False
    if record_path:
        record = {
            "message": {
                "message": line,
                "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))},
            }
        }
        if timeout is not None:  # tunelab run names the ranks that did not arrive from it.
            record[RECORD_KEY] = timeout.to_record()
        elif not isinstance(err, TunelabError) and peer_closed(err):
            record[PEER_CLOSED_KEY] = True  # another rank's exit caused it: not the cause
        try:
            with open(record_path, "w") as file:
                json.dump(record, file)
            recorded = True
        except OSError:
            pass
    reported = recorded and os.environ.get(REPORTED_BY_LAUNCHER_ENV) == "1"
    if restart_follows():
        # torchrun restarts the group and no launcher ever prints this: say why, on any rank.
        print(f"tunelab: error (restarting): {line}", file=sys.stderr, flush=True)
    elif not reported and _rank() == "0":
        # Plain torchrun or a hand start: no launcher prints the line, so rank 0 does.
        print(f"tunelab: error: {line}", file=sys.stderr, flush=True)
    sys.exit(1)


def _collective_timeout(err: BaseException, log_path: str | None) -> CollectiveTimeout | None:
    """``err`` as the timeout of a collective (see ``collective_timeout``), or None."""
    process_group = sys.modules.get("tunelab.distributed.process_group")
    timeout = process_group.collective_timeout() if process_group is not None else None
    found = describe_timeout(
        err,
        rank=int(_rank()),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        timeout_s=timeout.total_seconds() if timeout is not None else None,
    )
    return dataclasses.replace(found, log_path=log_path) if found is not None else None


class _ProgressSafeHandler(logging.Handler):
    """Writes ``tunelab: warning: ...`` lines through tqdm, so none lands on a progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
            tqdm.write(f"tunelab: {level}{record.getMessage()}", file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never break the run
            self.handleError(record)


LOG_LEVEL_ENV = "TUNELAB_LOG_LEVEL"
"""The library's log level on rank 0 (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``); default INFO.

Other ranks log at that level too, but never below WARNING: N copies of each INFO line help
nobody.
"""

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def configure_logging() -> None:
    """Route the library's log records (``logging.getLogger(__name__)``) to stderr, once.

    INFO and above on rank 0 (commits, clean-ups), WARNING and above elsewhere, unless
    ``TUNELAB_LOG_LEVEL`` says otherwise; each line is ``tunelab: [level: ]message`` (no level
    for INFO), written between progress bar refreshes.
    """
    logger = logging.getLogger("tunelab")
    if any(isinstance(handler, _ProgressSafeHandler) for handler in logger.handlers):
        return
    logger.addHandler(_ProgressSafeHandler())
    logger.propagate = False
    setting = os.environ.get(LOG_LEVEL_ENV, "").strip().upper()
    level = getattr(logging, setting) if setting in _LEVELS else logging.INFO
    logger.setLevel(level if _rank() == "0" else max(level, logging.WARNING))
    if setting and setting not in _LEVELS:
        logger.warning(
            "%s=%s is not a log level (%s): using INFO",
            LOG_LEVEL_ENV,
            os.environ[LOG_LEVEL_ENV],
            ", ".join(_LEVELS),
        )


def _close_progress_bars() -> None:
    # A bar left open would end its line after anything printed now.
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def recipe_main(
    main: Callable[[T], None], args_cls: type[T], argv: list[str] | None = None
) -> None:
    """Run a recipe's ``main`` with its validated settings; the script's entry point.

    Use it as ``if __name__ == "__main__": recipe_main(main, ARGS)``. It parses
    ``--config CONFIG [overrides]``, validates the config against ``args_cls`` and calls
    ``main(args)``. A failure ends the process with exit code 1 and one line: a
    ``TunelabError`` is its message; any other exception is ``rank N: <Type>: <message>``, its
    traceback appended to ``{output_dir}/logs/rank_N.log``. Under ``tunelab run`` the line is
    recorded in the rank's error file (torchrun's) and the launcher prints it once, as
    ``tunelab: error: <line>``; under plain torchrun or started by hand, rank 0 prints it.
    ``--debug`` or ``TUNELAB_DEBUG=1`` also shows the traceback.

    Before anything else it ties the process's life to its launcher's
    (``tunelab.lifecycle.exit_with_launcher``) and installs the stop-signal handlers: a
    SIGTERM or SIGINT ends the process with one line on rank 0 and exit code 128 + signal,
    after a committed checkpoint when it came during the training loop (see
    ``tunelab.lifecycle.Preemption``).

    Args:
        main: The recipe's training function; it takes the settings instance.
        args_cls: The recipe's ``RecipeArgs`` subclass.
        argv: The arguments (``sys.argv[1:]`` when None).
    """
    exit_with_launcher()
    install_stop_handlers()
    configure_logging()
    # What the recipe imported (torch, DTensor, tunelab: some 250,000 objects) lives as long
    # as the process: frozen, the collector's full collections no longer walk it (measured: a
    # 2-process tiny run's full collections took 0.55-0.6 CPU-s a rank, 0.25-0.4 after this).
    # Started by `tunelab run`, the imports ran with fewer collections (worker_start).
    restore_collector()
    gc.freeze()
    argv = sys.argv[1:] if argv is None else argv
    debug = debug_enabled(argv)
    args = None
    try:
        args = parse_args(parse_recipe_cli(argv, args_cls), args_cls)
        main(args)
    except TunelabError as err:
        _report_failure(err, args, debug)
    except TrainingStopped as stop:
        _exit_stopped(stop.signum, stop.message)
    except Exception as err:
        # After a stop signal, a peer that exited on it breaks the collective this rank was
        # in: one line says what happened, with the error; --debug shows its traceback.
        signum = signal_received()
        if signum is None:
            _report_failure(err, args, debug)
        if debug:
            raise
        first_line = next(iter(str(err).splitlines()), "")
        message = (
            f"stopped by {signal_name(signum)} before a checkpoint was committed "
            f"({type(err).__name__}: {first_line})"
        )
        stop_line_file = os.environ.get(STOP_LINE_FILE_ENV)
        if stop_line_file and os.environ.get("RANK", "0") == "0":
            with open(stop_line_file, "w") as file:
                file.write(message)
            _close_progress_bars()
            sys.exit(128 + signum)
        _exit_stopped(signum, message)
    signum = signal_received()
    if signum is not None:  # It came after the training loop: the run itself completed.
        _exit_stopped(signum, f"stopped by {signal_name(signum)} after training ended")


def _exit_stopped(signum: int, message: str) -> None:
    _close_progress_bars()
    if os.environ.get("RANK", "0") == "0":
        print(message, flush=True)
    sys.exit(128 + signum)
