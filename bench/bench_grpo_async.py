"""Asynchronous GRPO against synchronous GRPO: steps/s at equal tokens per step, reward curves.

Run (every run is a real ``tunelab run`` of ``grpo_distributed --config tiny/grpo``, one after
the other):

    python bench/bench_grpo_async.py                       # 2 processes, 3 seeds, 20 steps
    python bench/bench_grpo_async.py --nprocs 2,4 --steps 30

Both sides: the embedded tiny model, LoRA, the same prompts, ``rollout.num_generations`` 4,
``max_new_tokens`` 12, ``schedule.batch_size`` 2 per process (equal prompts and completions per
step; tokens per step differ only by where completions stop, printed). ``async`` is
``rollout.mode: async, rollout.max_lag: 1`` (the colocated variant: the same processes sample
and train in turn), ``sync`` the default.

Steps/s: each step's wall time is its completion tokens over the ``tokens_per_second`` the
recipe logs (from the step's start to its bookkeeping: sampling, training and logging; saving
and export are off), step 1 left out (warm-up); the median over steps, then over seeds. The
reward curve: each seed's mean ``reward`` over the run (the same number of samples on both
sides); async's seeds should fall within sync's spread over the seeds (min..max).

Target (issue 47): async steps/s at least 1.4x sync. The colocated variant does not overlap
sampling with training, so it is not expected to meet it; under load the ratio is noise of a
few percent either way. Processes get one thread each (``OMP_NUM_THREADS``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import Row, launch_env, parse_bench_args, print_table

TARGET_RATIO = 1.4
MODES = {"sync": (), "async": ("rollout.mode=async", "rollout.max_lag=1")}
GENERATIONS = 4


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", default="2", help="process counts, comma-separated")
    parser.add_argument("--seeds", default="0,1,2", help="seeds, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    return parse_bench_args(parser, ["--seeds", "0", "--steps", "2"])


def run_once(folder: Path, nproc: int, mode: str, seed: int, steps: int) -> list[dict]:
    """One ``tunelab run``; its metrics records."""
    out = folder / f"{mode}_{nproc}_{seed}"
    command = [
        str(Path(sys.executable).with_name("tunelab")), "run", "--nproc_per_node", str(nproc), "grpo_distributed",
        "--config", "tiny/grpo", f"output_dir={out}", f"seed={seed}",
        "schedule.batch_size=2", f"schedule.max_steps_per_epoch={steps}",
        "checkpoint.save_every_n_steps=null",
        *MODES[mode],
    ]  # fmt: skip
    env = launch_env(nproc) | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def step_seconds(metrics: list[dict], completions_per_step: int) -> list[float]:
    """Each step's wall time (tokens over tokens/s), step 1 (warm-up) left out."""
    return [
        m["completion_length"] * completions_per_step / m["tokens_per_second"] for m in metrics[1:]
    ]


def main() -> None:
    """Run both modes for every process count and seed; print the table."""
    args = parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    folder = Path(args.dir or tempfile.mkdtemp(prefix="bench_grpo_async_"))
    rows, notes = [], []
    for nproc in (int(n) for n in args.nprocs.split(",")):
        completions_per_step = 2 * nproc * GENERATIONS
        speed, rewards, tokens = {}, {}, {}
        for mode in MODES:
            per_seed, reward_means, token_means = [], [], []
            for seed in seeds:
                metrics = run_once(folder, nproc, mode, seed, args.steps)
                per_seed.append(1 / statistics.median(step_seconds(metrics, completions_per_step)))
                reward_means.append(statistics.fmean(m["reward"] for m in metrics))
                token_means.append(
                    statistics.fmean(m["completion_length"] * completions_per_step for m in metrics)
                )
            speed[mode] = statistics.median(per_seed)
            rewards[mode], tokens[mode] = reward_means, token_means
            notes.append(
                f"{nproc} processes, {mode}: steps/s per seed "
                f"{', '.join(f'{v:.2f}' for v in per_seed)}; mean reward per seed "
                f"{', '.join(f'{v:.3f}' for v in reward_means)}; completion tokens per step "
                f"{', '.join(f'{v:.1f}' for v in token_means)}"
            )
        ratio = speed["async"] / speed["sync"]
        rows.append(
            Row(
                f"steps/s, {nproc} processes, k=1",
                f"{speed['async']:.2f}",
                f"{speed['sync']:.2f}",
                f"{ratio:.2f}x",
                f">= {TARGET_RATIO}x",
                ratio >= TARGET_RATIO,
            )
        )
        low, high = min(rewards["sync"]), max(rewards["sync"])
        within = all(low <= value <= high for value in rewards["async"])
        rows.append(
            Row(
                f"mean reward over {args.steps} steps, {nproc} processes ({len(seeds)} seeds)",
                ", ".join(f"{v:.3f}" for v in rewards["async"]),
                f"{low:.3f}..{high:.3f}",
                "-",
                "within sync's spread",
                within,
            )
        )
    notes.append(
        f"tunelab column: rollout.mode async, max_lag 1 (colocated); alternative: sync. "
        f"{args.steps} steps, tiny/grpo, batch 2 per process x {GENERATIONS} completions, "
        f"1 thread per process, load {os.getloadavg()[0]:.1f} at the end. The colocated "
        "variant samples one batch and trains one per step, as sync does: no overlap."
    )
    print_table("GRPO: asynchronous (k=1) against synchronous", rows, notes)


if __name__ == "__main__":
    main()
