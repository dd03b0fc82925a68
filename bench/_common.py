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
import json
import os
import statistics
import subprocess
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


MODEL_SHAPES = ("tiny", "wide")
"""``--model`` of the side-by-side training benches: the embedded tiny model (hidden 128, where
per-call overhead dominates) or ``wide``, a random-init Llama-style model at a realistic width
(hidden 768, 4 layers, GQA 12/4, MLP 2048) with the tiny model's tokenizer and data."""


def bench_model_dir(shape: str, scratch: Path) -> Path:
    """The model folder a training bench runs on (see ``MODEL_SHAPES``), written once per scratch.

    Args:
        shape: ``tiny`` or ``wide``.
        scratch: The bench's scratch folder; ``wide`` is written under it.

    Returns:
        A Hugging Face model folder (config, safetensors, the tiny model's tokenizer files).
    """
    import json
    import shutil

    tiny = tiny_dir()
    if shape == "tiny":
        return tiny
    folder = scratch / f"model_{shape}"
    if (folder / "config.json").exists():
        return folder
    from _grpo_work import wide_config
    from _models import write_hf_checkpoint

    tiny_config = json.loads((tiny / "config.json").read_text())
    config = wide_config(768, 4, tiny_config["vocab_size"])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config[key] = tiny_config[key]
    write_hf_checkpoint(folder, config)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny / name, folder / name)
    return folder


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


# -- side-by-side rounds of two trainers -----------------------------------------------------


def alternating_rounds(
    run_side: Callable[[str, int], dict[str, float]], sides: Sequence[str], rounds: int
) -> dict[str, list[dict[str, float]]]:
    """Run every side once per round, the order reversed every other round (an ABBA crossover).

    Args:
        run_side: Runs one side (its name, the round) and returns its figures
            (``tokens`` and ``seconds`` at least).
        sides: The sides, in the first round's order.
        rounds: How many rounds.

    Returns:
        Side -> its figures, one dict per round, in round order.
    """
    results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for round_index in range(rounds):
        order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
        for side in order:
            results[side].append(run_side(side, round_index))
    return results


def throughput_row(
    figure: str,
    results: dict[str, list[dict[str, float]]],
    target: float,
    *,
    ours: str = "tunelab",
    theirs: str = "TRL",
    time_key: str = "seconds",
) -> tuple[Row, list[str]]:
    """The tokens/s row of two sides run in ``alternating_rounds``, and its per-round notes.

    The ratio is the median over rounds of the two sides' ratio within the round (each pair
    ran back to back, under the same load); ``met`` compares that median with ``target``.
    ``time_key`` picks the figures' time: ``seconds`` (wall) or ``cpu_seconds`` (the process's
    CPU time: with one intra-op thread per side, robust to other jobs' load).

    Returns:
        The row (each side's median tokens/s) and notes (every round's figures and ratio).
    """
    rates = {
        side: [figures["tokens"] / figures[time_key] for figures in runs]
        for side, runs in results.items()
    }
    unit = "tokens/s" if time_key == "seconds" else f"tokens per {time_key}"
    notes = [
        f"{unit} per round: "
        + "; ".join(
            f"{side} " + ", ".join(f"{rate:.0f}" for rate in side_rates)
            for side, side_rates in rates.items()
        )
    ]
    if theirs not in rates:
        return Row(figure, f"{statistics.median(rates[ours]):.0f}", "-", "-", "-", None), notes
    pairs = [mine / other for mine, other in zip(rates[ours], rates[theirs])]
    ratio = statistics.median(pairs)
    notes.append(
        f"{unit} ratio per round ({ours} / {theirs}): "
        + ", ".join(f"{pair:.2f}x" for pair in pairs)
        + f"; the row's ratio is their median; tokens per round: {ours} "
        + ", ".join(str(int(figures["tokens"])) for figures in results[ours])
        + f", {theirs} "
        + ", ".join(str(int(figures["tokens"])) for figures in results[theirs])
    )
    row = Row(
        figure,
        f"{statistics.median(rates[ours]):.0f}",
        f"{statistics.median(rates[theirs]):.0f}",
        f"{ratio:.2f}x",
        f">= {target}x",
        ratio >= target,
    )
    return row, notes


# -- a trainer bench: tunelab's step against TRL's trainer, each side its own process -------

TRAINER_SIDES = ("tunelab", "TRL")


def trl_installed() -> bool:
    """Whether TRL (the peer) can run here."""
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def add_trainer_bench_args(parser: argparse.ArgumentParser) -> None:
    """The flags every trainer bench takes: rounds, threads, model, scratch, the worker's own."""
    parser.add_argument(
        "--rounds", type=int, default=4, help="runs of each side (order alternating)"
    )
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each side")
    parser.add_argument(
        "--model", default="tiny", choices=MODEL_SHAPES,
        help="tiny: the embedded model (hidden 128); wide: random-init, hidden 768, 4 layers",
    )  # fmt: skip
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--worker", default=None, choices=TRAINER_SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)


TRL_CPU_SETTINGS: dict[str, Any] = {
    "learning_rate": 1e-4,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "lr_scheduler_type": "constant",
    "gradient_checkpointing": False,
    "bf16": False,  # every row here is fp32
    "use_cpu": True,
    "report_to": "none",
    "save_strategy": "no",
    "logging_strategy": "no",
    "dataloader_num_workers": 0,
    "seed": 0,
}
"""What every bench's TRL side sets alike (trainer benches through :func:`trl_settings`, the GRPO
benches through ``_grpo_trl.SHARED_SETTINGS``): AdamW at 1e-4 without decay, clipping at 1.0, a
constant schedule, fp32 on CPU with no gradient checkpointing, logging, saving or reporting."""


def trl_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The TRL config fields every trainer bench's TRL side sets alike (``trl.*Config(**...)``).

    ``1 + --steps`` steps (the first warms up) of ``--batch-size`` rows, AdamW at 1e-4 without
    decay, clipping at 1.0, a constant schedule, ``--max-length`` tokens; tuned as a careful
    user would for fp32 on CPU: no bf16 autocast (TRL's default), no gradient checkpointing,
    no logging, saving or reporting, data loaded in the training process.
    """
    return {
        "output_dir": str(Path(args.result).with_suffix("")),
        "per_device_train_batch_size": args.batch_size,
        "max_steps": 1 + args.steps,
        "max_length": args.max_length,
        **TRL_CPU_SETTINGS,
    }


def run_json_worker(command: Sequence[str], result: Path, threads: int, name: str) -> dict:
    """Run a worker process with ``threads`` intra-op threads and read the JSON it wrote.

    Raises:
        SystemExit: The worker failed (the end of its output is shown).
    """
    env = {**launch_env(1), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(list(command), env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(result.read_text())


def run_trainer_rounds(
    script: str, args: argparse.Namespace, data: Path, model_dir: Path, scratch: Path
) -> dict[str, list[dict[str, float]]]:
    """Each side as ``script --worker SIDE`` in a fresh process, ``--rounds`` alternating rounds.

    The worker gets the data and model folder and the bench's ``--steps``, ``--batch-size`` and
    ``--max-length``, runs with ``--threads`` intra-op threads and writes its figures as JSON.

    Returns:
        Side -> its figures per round (``alternating_rounds``); TRL only where installed.
    """

    def run_side(side: str, round_index: int) -> dict[str, float]:
        result = scratch / f"{side}_{round_index}.json"
        command = [
            sys.executable, script, "--worker", side, "--data", str(data),
            "--result", str(result), "--steps", str(args.steps), "--model-dir", str(model_dir),
            "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
        ]  # fmt: skip
        return run_json_worker(command, result, args.threads, side)

    sides = [side for side in TRAINER_SIDES if side != "TRL" or trl_installed()]
    return alternating_rounds(run_side, sides, args.rounds)


def throughput_rows(
    figure: str, results: dict[str, list[dict[str, float]]], target: float
) -> tuple[list[Row], list[str]]:
    """The wall-time and CPU-time rows of ``figure`` (its ``tokens/s``), and their round notes."""
    row, notes = throughput_row(figure, results, target)
    cpu_row, cpu_notes = throughput_row(
        figure.replace("tokens/s", "tokens per CPU-second"), results, target,
        time_key="cpu_seconds",
    )  # fmt: skip
    if "TRL" not in results:
        cpu_notes.append("trl not installed: no TRL row (make bench installs it)")
    return [row, cpu_row], [*notes, *cpu_notes[1:]]


def trainer_bench_main(
    args: argparse.Namespace,
    workers: dict[str, Callable[[argparse.Namespace], dict]],
    orchestrate: Callable[[argparse.Namespace], None],
) -> None:
    """With ``--worker SIDE``: run that side here and write its result JSON; else orchestrate."""
    if args.worker:
        Path(args.result).write_text(json.dumps(workers[args.worker](args)))
    else:
        orchestrate(args)
