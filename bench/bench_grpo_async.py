"""Asynchronous GRPO against synchronous GRPO: steps/s at equal tokens per step, reward curves.

Run (every run is a real ``tunelab run`` of ``grpo_distributed --config tiny/grpo``, one after
the other):

    python bench/bench_grpo_async.py                       # 2 processes, 3 seeds, 64 steps
    python bench/bench_grpo_async.py --nprocs 2,4 --seeds 3,4,5
    python bench/bench_grpo_async.py --lr 3e-3             # tiny/grpo's own learning rate

Every side: the embedded tiny model, LoRA, the same prompts, ``rollout.num_generations`` 4,
``max_new_tokens`` 12, 2 prompts per process per step (equal prompts and completions per step;
tokens per step differ only by where completions stop, printed). ``sync`` is the default;
``colocated`` is ``rollout.mode: async, rollout.max_lag: 1`` (the same processes sample and
train in turn: no overlap); ``overlap`` adds ``rollout.overlap: true`` (a worker thread samples
batch s + 1 on a whole copy of the model while step s trains, on the same processes); ``split``
is async k=1 with ``rollout.ranks`` half the processes (the other half train,
``schedule.batch_size`` 4 each: the same prompts per step), so sampling step s + 1 overlaps
training step s. The runs alternate (seed by seed, the modes in that order).

Steps/s: each step's wall time is its completion tokens over the ``tokens_per_second`` the
recipe logs (from the step's start to its bookkeeping: sampling, training and logging; saving
and export are off), step 1 left out (warm-up); the median over steps, then over seeds. CPU
seconds per step: every process of the run (``/proc``), from when step 1's metrics appear to
when the last step's do; over the wall time of that window, sync's share of idle cores, the
most any overlap on those cores could reclaim (under load it counts waiting for a core as
idle, so it overstates that bound). The reward curve: see :func:`reward_row`.

The learning rate (``--lr``, every mode) is 5e-4, not ``tiny/grpo``'s 3e-3 (a demonstration
config that climbs to a reward near 1 in about 10 updates). At 5e-4 the policy moves per update
about as much as in real fine-tuning: the trainer-vs-rollout KL per token of a lag-1 batch
(``off_policy/kl``, printed per mode) is about 1e-3 after the first lagged step (5e-3 to 2e-2 at
step 2, where Adam's first, full-size update shows), against about 5e-3 at 3e-3; and sync still
climbs visibly in 30 steps (8 prompts a step: from about 0.2 to 0.49-0.72 over its last 10).
Async k=1 samples each batch with the policy one update older, so in the take-off, where one
update changes the reward most, its curve trails sync's; the figures of 5e-4, 1e-3 and 3e-3
are in docs/benchmarks.md (grpo_async).

Target (issue 47): async steps/s at least 1.4x sync. The plain colocated variant does not
overlap sampling with training, so it is not expected to meet it. ``overlap`` fills the time
the training thread waits (collectives, the slower rank) and samples on a plain copy, which
costs less CPU than sampling on the FSDP model; on a loaded machine the scheduler also gives its
two threads a larger share of the cores than a one-thread process gets, which is not overlap
(compare its CPU seconds per step and the load). The split one overlaps, but each side has half
the processes: on CPU its step takes max(sampling, training) on half the cores against their
sum on all of them in sync; it wins by doing less work (one process samples all the rows and
trains without FSDP's collectives: see its CPU seconds per step). Processes get one thread
each (``OMP_NUM_THREADS``); 4 processes on a 2-core machine are oversubscribed (said in the
notes, with the load average).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _common import Row, launch_env, parse_bench_args, print_table
from _system import process_tree_cpu_seconds

TARGET_RATIO = 1.4
ASYNC = ("rollout.mode=async", "rollout.max_lag=1")
MODES = ("sync", "colocated", "overlap", "split")
PROMPTS_PER_PROCESS = 2
LR = "5e-4"  # per update, about the policy change of real fine-tuning (module doc)
POLL_SECONDS = 0.01  # how often the metrics file is looked at (a stat and a small read)
MIN_SEEDS = 3  # the reward criterion: sync's spread over 3 seeds
SPLIT_SECONDS = {
    "async/trainer_idle_seconds": "trainer waiting for batches",
    "async/weight_send_blocked_seconds": "trainer blocked by the policy send",
    "async/weight_transfer_seconds": "policy transfer (background)",
    "async/rollout_idle_seconds": "rollout rank waiting",
}


def mode_overrides(mode: str, nproc: int) -> tuple[str, ...]:
    """The settings of ``mode`` on ``nproc`` processes (equal prompts per step in every mode)."""
    if mode == "sync":
        return (f"schedule.batch_size={PROMPTS_PER_PROCESS}",)
    if mode == "colocated":
        return (f"schedule.batch_size={PROMPTS_PER_PROCESS}", *ASYNC)
    if mode == "overlap":
        return (f"schedule.batch_size={PROMPTS_PER_PROCESS}", *ASYNC, "rollout.overlap=true")
    rollout_ranks = max(nproc // 2, 1)
    per_trainer = PROMPTS_PER_PROCESS * nproc // (nproc - rollout_ranks)
    return (f"schedule.batch_size={per_trainer}", *ASYNC, f"rollout.ranks={rollout_ranks}")


GENERATIONS = 4
PROMPT_ROWS = 256  # tiny/grpo's prompts (assets/tiny/grpo_prompts.jsonl)
STEPS = 64  # one pass over the prompts on 2 processes, two on 4 (module doc: the reward row)


def schedule_overrides(steps: int, nproc: int) -> tuple[str, ...]:
    """``steps`` optimizer steps in as many passes over the prompts as they need (equal passes)."""
    prompts_per_step = PROMPTS_PER_PROCESS * nproc
    epochs = -(-steps * prompts_per_step // PROMPT_ROWS)
    if steps % epochs:
        raise SystemExit(f"--steps {steps}: {nproc} processes need a multiple of {epochs}")
    return (f"schedule.epochs={epochs}", f"schedule.max_steps_per_epoch={steps // epochs}")


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", default="2", help="process counts, comma-separated")
    parser.add_argument("--seeds", default="0,1,2", help="seeds, comma-separated")
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per run")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--lr", default=LR, help=f"optimizer.lr of every mode (default {LR})")
    return parse_bench_args(parser, ["--seeds", "0", "--steps", "2"])


@dataclass
class Run:
    """One ``tunelab run``'s metrics and CPU figures.

    Attributes:
        metrics: Its metrics records, one per step.
        cpu_seconds: CPU seconds of all its processes, start-up and export included.
        cpu_per_step: CPU seconds per step of all its processes from the end of step 1 to
            the end of the last step (process-tree snapshots when their metrics appear).
        wall_per_step: Wall seconds per step over the same window.
    """

    metrics: list[dict]
    cpu_seconds: float
    cpu_per_step: float
    wall_per_step: float


def run_once(folder: Path, nproc: int, mode: str, seed: int, steps: int, lr: str) -> Run:
    """One ``tunelab run`` of ``mode``, its CPU snapshotted when step 1's and the last step's metrics appear."""
    out = folder / f"{mode}_{nproc}_{seed}"
    command = [
        str(Path(sys.executable).with_name("tunelab")), "run", "--nproc_per_node", str(nproc), "grpo_distributed",
        "--config", "tiny/grpo", f"output_dir={out}", f"seed={seed}",
        *schedule_overrides(steps, nproc), "checkpoint.save_every_n_steps=null",
        f"optimizer.lr={lr}", *mode_overrides(mode, nproc),
    ]  # fmt: skip
    env = launch_env(nproc) | {"OMP_NUM_THREADS": "1"}
    metrics_file = out / "logs" / "metrics.jsonl"
    log = folder / f"{mode}_{nproc}_{seed}.log"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    snapshots: dict[int, tuple[float, float]] = {}  # steps logged -> (wall, CPU of the tree)
    with open(log, "w") as printed:
        launched = subprocess.Popen(command, env=env, stdout=printed, stderr=subprocess.STDOUT)
        while launched.poll() is None:
            logged = metrics_file.read_bytes().count(b"\n") if metrics_file.exists() else 0
            for mark in (1, steps):
                if logged >= mark and mark not in snapshots:
                    snapshots[mark] = (time.perf_counter(), process_tree_cpu_seconds(launched.pid))
            time.sleep(POLL_SECONDS)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if launched.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{log.read_text()[-6000:]}")
    if len(snapshots) < 2 or steps < 2:
        raise SystemExit(f"{out}: the run ended before its steps could be timed (steps >= 2)")
    (wall_1, cpu_1), (wall_n, cpu_n) = snapshots[1], snapshots[steps]
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return Run(metrics, cpu, (cpu_n - cpu_1) / (steps - 1), (wall_n - wall_1) / (steps - 1))


def step_seconds(metrics: list[dict], completions_per_step: int) -> list[float]:
    """Each step's wall time (tokens over tokens/s), step 1 (warm-up) left out."""
    return [
        m["completion_length"] * completions_per_step / m["tokens_per_second"] for m in metrics[1:]
    ]


def off_policy_means(run: Run) -> tuple[float, float]:
    """Mean ``off_policy/kl`` and ``off_policy/clip_fraction`` over steps 2.. (step 1: lag 0)."""
    later = run.metrics[1:]
    return (
        statistics.fmean(m["off_policy/kl"] for m in later),
        statistics.fmean(m["off_policy/clip_fraction"] for m in later),
    )


def reward_row(
    mode_label: str, nproc: int, steps: int, seeds: list[int], sync: list[float], ours: list[float]
) -> Row:
    """The issue's reward criterion: ``ours``' curve (mean over the seeds) within ``sync``'s spread.

    Both sides ran the same seeds (the same prompts in the same order, the same sampling seeds),
    the same steps and completions per step: the same samples. The curve's figure is the mean
    reward over the run (every sample weighed once); ``ours`` is the mean over the seeds, set
    against sync's lowest and highest seed. Each async seed against that spread separately is
    not a sound test: three runs drawn like the three sync runs all fall inside their range
    about one time in five (simulated: 0.20 independent, 0.23-0.25 paired by seed, since two of
    the three seeds are sync's extremes and a paired async seed lands beyond its own half the
    time), so it says ``no`` to an async run that learns exactly as sync does. Fewer than 3
    seeds: no criterion (``-``).

    The run is :data:`STEPS` long (a whole pass over the prompts on 2 processes). Async k=1
    samples step s with the policy of step s - 1, so its curve trails sync's by about one
    update's rise; over 30 steps, nearly all take-off at lr 5e-4, that lag alone is most of a
    seed's spread (session 19: seeds 0-2 inside by 0.006, seeds 3-5 outside by 0.006), while
    over a run that also reaches the plateau it is a small part of the mean, as in real
    fine-tuning, which runs hundreds of updates.
    """
    low, high = min(sync), max(sync)
    mean = statistics.fmean(ours)
    return Row(
        f"mean reward over {steps} steps, {nproc} processes, {mode_label} (mean of seeds "
        f"{', '.join(str(s) for s in seeds)})",
        f"{mean:.3f}",
        f"{low:.3f}..{high:.3f}",
        "-",
        "within sync's spread over the seeds",
        low <= mean <= high if len(seeds) >= MIN_SEEDS else None,
    )


def main() -> None:
    """Run the modes for every process count and seed; print the table."""
    args = parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    folder = Path(args.dir or tempfile.mkdtemp(prefix="bench_grpo_async_"))
    folder.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    rows, notes = [], []
    for nproc in (int(n) for n in args.nprocs.split(",")):
        completions_per_step = PROMPTS_PER_PROCESS * nproc * GENERATIONS
        runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
        loads = []
        for seed in seeds:  # the modes side by side, round by round
            for mode in MODES:
                runs[mode].append(run_once(folder, nproc, mode, seed, args.steps, args.lr))
            loads.append(os.getloadavg()[0])
        speed = {}
        for mode in MODES:
            per_seed = [
                1 / statistics.median(step_seconds(run.metrics, completions_per_step))
                for run in runs[mode]
            ]
            speed[mode] = statistics.median(per_seed)
            rewards = [statistics.fmean(m["reward"] for m in run.metrics) for run in runs[mode]]
            kls, clips = zip(*(off_policy_means(run) for run in runs[mode]), strict=True)
            # Async's batch of step s comes from the policy of step s - 1: its curve one step
            # earlier, against sync's one step shorter, shows what that delay alone costs.
            delayed = [
                (
                    statistics.fmean(m["reward"] for m in ours.metrics[1:]),
                    statistics.fmean(m["reward"] for m in theirs.metrics[:-1]),
                )
                for ours, theirs in zip(runs[mode], runs["sync"], strict=True)
            ]
            tokens = [
                statistics.fmean(m["completion_length"] * completions_per_step for m in run.metrics)
                for run in runs[mode]
            ]
            notes.append(
                f"{nproc} processes, {mode}: steps/s per seed "
                f"{', '.join(f'{v:.2f}' for v in per_seed)}; mean reward per seed "
                f"{', '.join(f'{v:.3f}' for v in rewards)}; trainer-vs-rollout KL per token "
                f"(off_policy/kl, k3) per seed, mean of steps 2..{args.steps} "
                f"{', '.join(f'{v:.2g}' for v in kls)}, IS clip fraction "
                f"{', '.join(f'{v:.3f}' for v in clips)}"
                + (
                    ""
                    if mode == "sync"
                    else "; mean reward of steps 2.. against sync's steps ..N-1 per seed "
                    + ", ".join(f"{a:.3f} vs {b:.3f}" for a, b in delayed)
                )
                + "; completion tokens per step "
                f"{', '.join(f'{v:.1f}' for v in tokens)}; CPU seconds per step (all processes, "
                f"steps 2..{args.steps}) {', '.join(f'{r.cpu_per_step:.3f}' for r in runs[mode])}"
                f" over wall {', '.join(f'{r.wall_per_step:.3f}' for r in runs[mode])}; CPU "
                f"seconds per whole run {', '.join(f'{r.cpu_seconds:.0f}' for r in runs[mode])}"
            )
        split_metrics = [m for run in runs["split"] for m in run.metrics[1:]]
        notes.append(
            f"{nproc} processes, split: median seconds per step (step 1 left out), "
            + ", ".join(
                f"{label} {statistics.median(m[key] for m in split_metrics):.4f}"
                for key, label in SPLIT_SECONDS.items()
            )
        )
        notes.append(
            f"{nproc} processes: load average after each round "
            f"{', '.join(f'{v:.1f}' for v in loads)}"
            + (f"; OVERSUBSCRIBED: {nproc} processes on {cores} cores" if nproc > cores else "")
        )
        cpu = {mode: statistics.median(r.cpu_per_step for r in runs[mode]) for mode in MODES}
        # The cores a sync step leaves idle: all any overlap on these cores could fill.
        busy = statistics.median(
            r.cpu_per_step / (r.wall_per_step * min(nproc, cores)) for r in runs["sync"]
        )
        rows.append(
            Row(
                f"sync step, {nproc} processes on {min(nproc, cores)} cores: share of the cores "
                "idle (bound on any overlap there: 1 / (1 - idle))",
                f"{1 - busy:.0%}",
                "-",
                f"{1 / busy:.2f}x bound",
                f"{TARGET_RATIO}x needs >= {1 - 1 / TARGET_RATIO:.0%}",
                None,
            )
        )
        sync_rewards = [statistics.fmean(m["reward"] for m in r.metrics) for r in runs["sync"]]
        for mode, label in (
            ("colocated", "colocated"),
            ("overlap", "colocated, rollout.overlap (sampling thread)"),
            ("split", f"split {max(nproc // 2, 1)} rollout ranks"),
        ):
            ratio = speed[mode] / speed["sync"]
            rows.append(
                Row(
                    f"steps/s, {nproc} processes, k=1, {label}",
                    f"{speed[mode]:.2f}",
                    f"{speed['sync']:.2f}",
                    f"{ratio:.2f}x",
                    f">= {TARGET_RATIO}x",
                    ratio >= TARGET_RATIO,
                )
            )
            rows.append(
                Row(
                    f"CPU seconds per step (all processes), {nproc} processes, k=1, {label}",
                    f"{cpu[mode]:.3f}",
                    f"{cpu['sync']:.3f}",
                    f"{cpu['sync'] / cpu[mode]:.2f}x",
                    "-",
                    None,
                )
            )
            kl = statistics.fmean(off_policy_means(r)[0] for r in runs[mode])
            sync_kl = statistics.fmean(off_policy_means(r)[0] for r in runs["sync"])
            rows.append(
                Row(
                    f"trainer-vs-rollout KL per token per step (off_policy/kl, steps "
                    f"2..{args.steps}, mean of seeds), {nproc} processes, {label}, lr {args.lr}",
                    f"{kl:.2g}",
                    f"{sync_kl:.1g}",
                    "-",
                    "-",
                    None,
                )
            )
            ours = [statistics.fmean(m["reward"] for m in r.metrics) for r in runs[mode]]
            rows.append(reward_row(label, nproc, args.steps, seeds, sync_rewards, ours))
    notes.append(
        f"tunelab column: rollout.mode async, max_lag 1, colocated (plain, or with "
        f"rollout.overlap) or split (rollout.ranks half the processes); alternative: sync. {args.steps} steps, tiny/grpo, "
        f"{PROMPTS_PER_PROCESS} prompts per process x {GENERATIONS} completions per step, 1 "
        "thread per process. CPU per step: every process of the run, from the end of step 1 to "
        "the end of the last step; the idle share: 1 - CPU / (wall x cores the processes "
        "can use), over the same window (under load, time waiting for a core counts as idle)."
    )
    print_table("GRPO: asynchronous (k=1) against synchronous", rows, notes)


if __name__ == "__main__":
    main()
