"""``tunelab eval``: the short form of ``tunelab run [TORCHRUN OPTIONS] eval ...``."""

from __future__ import annotations

import argparse

USAGE = """\
usage: tunelab eval [TORCHRUN OPTIONS] --config CONFIG [OVERRIDE ...]

Evaluate a model on lm-evaluation-harness tasks: the same as
`tunelab run [TORCHRUN OPTIONS] eval --config CONFIG [OVERRIDE ...]` (see `tunelab run --help`).

  CONFIG      a config of the eval recipe: a built-in name (tiny/eval) or a YAML path
  OVERRIDE    key=value, a.b.c=value or ~key (tasks=[arc_easy,hellaswag] limit=100 ...)

Torchrun options (--nproc_per_node 4, ...) come before --config.
"""

RECIPE = "eval"


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the ``eval`` subcommand; its arguments are read by :func:`as_run_arguments`."""
    parser = subparsers.add_parser(
        "eval",
        add_help=False,
        help="evaluate a model on lm-eval benchmarks (tunelab run eval ...)",
        usage="tunelab eval [TORCHRUN OPTIONS] --config CONFIG [OVERRIDE ...]",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER)


def as_run_arguments(argv: list[str]) -> list[str] | None:
    """``tunelab run``'s arguments for ``tunelab eval ARGS``, or None when help is asked for.

    Everything before ``--config`` is torchrun's; the recipe ``eval`` goes right before it.

    Args:
        argv: Everything after ``eval``.

    Returns:
        The arguments for ``tunelab run``, or None for ``-h`` / ``--help`` (the caller prints
        :data:`USAGE`).
    """
    if not argv or argv[0] in ("-h", "--help"):
        return None
    at = next(
        (i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")),
        len(argv),
    )
    return [*argv[:at], RECIPE, *argv[at:]]
