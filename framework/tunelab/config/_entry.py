"""The command line of a recipe script: ``recipe.py --config PATH [overrides]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

from omegaconf import DictConfig

from tunelab.config._load import load_config
from tunelab.config._validate import parse_args
from tunelab.errors import TunelabError
from tunelab.lifecycle import (
    TrainingStopped,
    exit_with_launcher,
    install_stop_handlers,
    signal_received,
)
from tunelab.lifecycle.preemption import signal_name

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


def parse_recipe_cli(argv: list[str] | None = None) -> DictConfig:
    """Parse a recipe's command line and load its config.

    Args:
        argv: The arguments (``sys.argv[1:]`` when None): ``--config CONFIG [overrides]``.

    Returns:
        The loaded config with the overrides applied.

    Raises:
        ConfigError: If the config cannot be loaded or an override is bad.
    """
    namespace = _recipe_parser().parse_intermixed_args(argv)
    return load_config(namespace.config, namespace.overrides)


def debug_enabled(argv: list[str] | None = None) -> bool:
    """Return whether tracebacks of tunelab errors should show (``--debug``/``TUNELAB_DEBUG=1``)."""
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("TUNELAB_DEBUG", "") not in ("", "0")


def _record_for_launcher(err: TunelabError) -> None:
    # torchrun gives every rank an error file (its `record` format); the launcher reads it, so
    # `tunelab run` can report an error that only a non-zero rank hit, which prints nothing.
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {
        "message": {
            "message": str(err),
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        with open(path, "w") as file:
            json.dump(record, file)
    except OSError:
        pass  # Only the launcher's summary loses detail.


def recipe_main(
    main: Callable[[T], None], args_cls: type[T], argv: list[str] | None = None
) -> None:
    """Run a recipe's ``main`` with its validated settings; the script's entry point.

    Use it as ``if __name__ == "__main__": recipe_main(main, ARGS)``. It parses
    ``--config CONFIG [overrides]``, validates the config against ``args_cls`` and calls
    ``main(args)``. A ``TunelabError`` becomes one line on stderr, ``tunelab: error: <message>``
    (printed by rank 0 only when ``RANK`` is set, since every rank usually fails alike; under
    torchrun every rank also records it in its error file for the launcher), and exit code 1;
    ``--debug`` or ``TUNELAB_DEBUG=1`` shows the traceback instead.

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
    argv = sys.argv[1:] if argv is None else argv
    debug = debug_enabled(argv)
    try:
        main(parse_args(parse_recipe_cli(argv), args_cls))
    except TunelabError as err:
        _record_for_launcher(err)
        if os.environ.get("RANK", "0") == "0":
            if debug:
                traceback.print_exc()
            print(f"tunelab: error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    except TrainingStopped as stop:
        _exit_stopped(stop.signum, stop.message)
    except Exception as err:
        # After a stop signal, a peer that exited on it breaks the collective this rank was
        # in: one line says what happened, with the error; --debug shows its traceback.
        signum = signal_received()
        if signum is None or debug:
            raise
        first_line = next(iter(str(err).splitlines()), "")
        _exit_stopped(
            signum,
            f"stopped by {signal_name(signum)} before a checkpoint was committed "
            f"({type(err).__name__}: {first_line})",
        )
    signum = signal_received()
    if signum is not None:  # It came after the training loop: the run itself completed.
        _exit_stopped(signum, f"stopped by {signal_name(signum)} after training ended")


def _exit_stopped(signum: int, message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(message, flush=True)
    sys.exit(128 + signum)
