"""Helpers shared by the benchmark scripts: launching, collectives, timing, the table.

Benchmarks are not tests: they print one table of figures measured side by side in one run
(tunelab's path, the alternative a user would otherwise run, their ratio, the target and
whether it is met). Absolute times depend on the machine and its load; the ratios are the
claim.

Every script takes ``--smoke`` (``parse_bench_args`` below): its smallest sizes, so that it runs in
seconds and prints its table. Smoke figures mean nothing; ``tests/unit/test_bench_smoke.py``
runs each script so, so that a benchmark that no longer runs fails ``make test``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The launching helpers live in _launch; the scripts import them from here too.
from _launch import free_port, launch_env, relaunch_under_torchrun, torchrun  # noqa: F401

# Before any torch import in this process. torch itself is imported in the functions that use
# it, so that an orchestrating process that only launches workers never loads it (seconds of CPU).
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

MiB = 2**20
GiB = 2**30


# -- collectives -------------------------------------------------------------------------


def is_main() -> bool:
    """Whether this process is rank 0 (or the only process)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    """A barrier when a process group exists."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def gather_floats(value: float) -> list[float]:
    """``value`` of every rank, in rank order (on every rank)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    values = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    values[dist.get_rank()] = value
    dist.all_reduce(values)
    return values.tolist()


# -- command line ------------------------------------------------------------------------

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every projection of a Llama-style block: the LoRA targets of the side-by-side benches."""


def tiny_dir() -> Path:
    """The embedded tiny model's folder (its data files too)."""
    from tunelab._paths import assets_dir

    return assets_dir() / "tiny"


SMOKE_HELP = "smallest sizes: checks that the script runs (seconds; the figures mean nothing)"


def parse_bench_args(
    parser: argparse.ArgumentParser, smoke: Sequence[str], argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Parse the command line, with ``--smoke`` standing for the script's smallest sizes.

    Args:
        parser: The script's flags (``--smoke`` is added here).
        smoke: The flags ``--smoke`` stands for. They go before the command line's own, so a
            flag given explicitly still wins (``--smoke --repeats 3``).
        argv: The arguments; ``None`` reads ``sys.argv``.

    Returns:
        The parsed flags, with ``smoke`` set when ``--smoke`` was given.
    """
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*smoke, *argv])
    return args


# -- timing ------------------------------------------------------------------------------


def time_collective(action: Callable[[], Any]) -> float:
    """Seconds from a barrier before ``action`` to a barrier after it (the slowest rank)."""
    barrier()
    start = time.perf_counter()
    action()
    barrier()
    return time.perf_counter() - start


def median(values: Iterable[float]) -> float:
    """The median of ``values``."""
    return statistics.median(list(values))


# -- output ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of a benchmark table."""

    figure: str
    tunelab: str
    alternative: str
    ratio: str
    target: str
    met: bool | None
    """None when the row has no target."""
    extra: tuple[str, ...] = ()
    """Values of the table's extra columns, if any."""


def print_table(
    title: str,
    rows: Sequence[Row],
    notes: Sequence[str] = (),
    extra_columns: Sequence[str] = (),
) -> None:
    """Print a markdown table of ``rows`` under ``title``, then ``notes``.

    Args:
        title: The table's heading.
        rows: Its lines.
        notes: Sentences printed under the table (sizes, settings, raw values).
        extra_columns: Names of columns after the six standard ones.
    """
    columns = ["figure", "tunelab", "alternative", "ratio", "target", "met", *extra_columns]
    lines = [
        f"\n### {title}\n",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        met = "-" if row.met is None else ("yes" if row.met else "no")
        cells = [row.figure, row.tunelab, row.alternative, row.ratio, row.target, met, *row.extra]
        lines.append("| " + " | ".join(cells) + " |")
    lines.extend(f"\n{note}" if i == 0 else note for i, note in enumerate(notes))
    print("\n".join(lines), flush=True)


def seconds(value: float) -> str:
    """``value`` seconds, formatted for a table."""
    return f"{value:.3f} s"


def mebibytes(value: float) -> str:
    """``value`` bytes as MiB, formatted for a table."""
    return f"{value / MiB:.0f} MiB"
