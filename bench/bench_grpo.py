"""GRPO: tunelab's grpo_distributed step against TRL's GRPOTrainer, side by side (issue 40).

Run (``make bench`` installs trl with the ``bench`` extra):

    python bench/bench_grpo.py                 # every shape, both layouts, 2 rounds
    python bench/bench_grpo.py --smoke         # its smallest sizes: checks it runs

Shapes (``--shapes``): ``tiny-16``, the embedded 5M-parameter model (overhead-bound), and
``wide-16`` / ``wide-512``, a random-init Llama-style model (``--dim`` 768, ``--layers`` 4,
GQA 12/4, MLP 2048, ``--vocab-size`` 4096) with prompts of 16 and of 512 tokens. Each step:
``--prompts`` 8 prompts x ``--num-generations`` 4 completions of exactly ``--max-new-tokens``
tokens (stop tokens unreachable on both sides: see ``_grpo_work``), sampled at temperature 1,
LoRA r=8 on every projection, fp32, DAPO token-mean loss, beta 0, one iteration, one optimizer
step. tunelab: the recipe's pieces in its order (``_grpo_tunelab``); TRL: ``GRPOTrainer``
(``_grpo_trl``). Layouts (``--layouts``): 1 process x 2 threads, 2 processes x 1 thread (DDP
on TRL's side, FSDP2 on tunelab's; the step's prompts split over the processes).

Every launch runs one side, one shape, one layout in fresh processes: 1 warm-up step, then
``--steps`` timed steps (their median; per step the slowest process). ``--rounds`` rounds, the
order of the two sides alternating from round to round; each figure is the median over rounds.
Before a step or generation ratio is printed, each round's work is compared (completions,
prompt and completion tokens, every step): where it differs the table says so and gives none.
Rows: step time (with the rollout and update halves), step CPU time (``time.process_time`` of
the slowest process: robust to other load, no target of its own), generation tokens/s (the ``generate``
calls only), peak RSS per process (the whole run, the build included). One more row measures
the log-prob pass's memory at a large vocabulary (``_grpo_logps``).

Targets (issue 40): step time and generation tokens/s at least 1.5x TRL's, peak RSS at most
0.9x; log-prob pass peak memory at most 0.5x (issue 26). Without trl, no TRL column.
"""

import argparse
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from _common import Row, launch_env, mebibytes, parse_bench_args, print_table, seconds, torchrun
from _grpo_work import Shape, prepare, work_difference

HERE = Path(__file__).resolve().parent
NOT_MEASURED = "not measured"
NOT_COMPARABLE = "none: not the same work"
SHAPES = {
    "tiny-16": Shape("tiny-16", "tiny", 16),
    "wide-16": Shape("wide-16", "wide", 16),
    "wide-512": Shape("wide-512", "wide", 512),
}


def parse_args() -> argparse.Namespace:
    """Command-line flags (the orchestrator's, and a worker's own)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    parser.add_argument("--layouts", default="1x2,2x1", help="processes x threads, each")
    parser.add_argument("--rounds", type=int, default=2, help="side pairs, order alternating")
    parser.add_argument("--steps", type=int, default=2, help="timed steps (after a warm-up)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (all ranks)")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--logps-vocab-size", type=int, default=128256)
    parser.add_argument("--logps-completion-tokens", type=int, default=1024)
    parser.add_argument("--logps-dim", type=int, default=256)
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep the scratch folder and reuse the launches already done there by a run with "
        "the same flags (finish a long run on a loaded machine in parts)",
    )
    parser.add_argument("--worker", choices=["tunelab", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--shape-file", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    smoke = ["--shapes", "wide-16", "--layouts", "1x1", "--rounds", "1", "--steps", "1",
             "--prompts", "2", "--num-generations", "2", "--max-new-tokens", "4", "--dim", "128",
             "--layers", "1", "--vocab-size", "512", "--logps-vocab-size", "1024",
             "--logps-completion-tokens", "16", "--logps-dim", "64"]  # fmt: skip
    return parse_bench_args(parser, smoke)


def trl_installed() -> bool:
    """Whether the TRL side can run here."""
    return importlib.util.find_spec("trl") is not None


def launch(side: str, shape_file: Path, layout: str, args: argparse.Namespace, result: Path):
    """One side on one shape in ``layout`` (``PxT``: P processes of T threads), under torchrun
    (``_launch.torchrun``: one process is started with its environment, without the agent).

    Returns:
        The result the launch's rank 0 wrote (see ``_grpo_results.finish``).
    """
    nproc, threads = (int(n) for n in layout.split("x"))
    env = launch_env(nproc) | {"OMP_NUM_THREADS": str(threads)}
    worker = [
        "--worker", side, "--shape-file", str(shape_file), "--result", str(result),
        "--steps", str(args.steps), "--prompts", str(args.prompts),
        "--num-generations", str(args.num_generations),
        "--max-new-tokens", str(args.max_new_tokens),
    ]  # fmt: skip
    done = torchrun(HERE / "bench_grpo.py", worker, nproc, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write((done.stdout + done.stderr)[-6000:])
        raise SystemExit(f"bench_grpo: the {side} launch ({shape_file.stem}, {layout}) failed")
    return json.loads(result.read_text())


def summary(result: dict) -> dict[str, float]:
    """One launch's figures: medians over its timed steps, tokens/s, the peak RSS."""
    timed = result["steps"][1:]
    figures = {key: statistics.median(s[key] for s in timed) for key in timed[0]}
    generate_s = sum(s["generate_s"] for s in timed)
    figures["tokens_per_s"] = sum(s["generated_tokens"] for s in timed) / generate_s
    figures["peak_rss"] = max(map(max, (result["load_peak_rss"], result["peak_rss"])))
    figures["step_peak_rss"] = max(result["peak_rss"])
    return figures


def median_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the rounds."""
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def measure(args: argparse.Namespace, root: Path) -> dict:
    """Every launch, rounds outermost; per (shape, layout): both sides' rounds and any difference."""
    shapes = [SHAPES[name] for name in args.shapes.split(",")]
    layouts = args.layouts.split(",")
    for layout in layouts:
        if args.prompts % int(layout.split("x")[0]):
            raise SystemExit(f"--prompts {args.prompts} does not split over layout {layout}")
    files = prepare(root, args, shapes)
    sides = ["tunelab", "trl"] if trl_installed() else ["tunelab"]
    measured = {(s.name, layout): {"tunelab": [], "trl": [], "difference": None}
                for s in shapes for layout in layouts}  # fmt: skip
    for round_index in range(args.rounds):
        order = sides if round_index % 2 == 0 else sides[::-1]
        for shape in shapes:
            for layout in layouts:
                entry = measured[(shape.name, layout)]
                results = {}
                for side in order:
                    path = root / f"{side}_{shape.name}_{layout}_{round_index}.json"
                    if args.reuse and path.exists():
                        results[side] = json.loads(path.read_text())
                    else:
                        results[side] = launch(side, files[shape.name], layout, args, path)
                    entry[side].append(summary(results[side]))
                if "trl" in results and entry["difference"] is None:
                    difference = work_difference(results["tunelab"]["work"], results["trl"]["work"])
                    entry["difference"] = difference and f"round {round_index}: {difference}"
    return measured


def rows_for(name: str, layout: str, entry: dict) -> list[Row]:
    """The step, generation and memory rows of one shape in one layout."""
    ours = median_of(entry["tunelab"])
    theirs = median_of(entry["trl"]) if entry["trl"] else None
    label = f"{name}, {layout.replace('x', ' proc x ')} thr"
    split = ("-", "-")
    if theirs is None:
        return [Row(f"step time, {label}", seconds(ours["step_s"]), NOT_MEASURED, "-",
                    ">= 1.5x", None, split)]  # fmt: skip
    halves = tuple(
        f"{seconds(ours[k])} / {seconds(theirs[k])} ({theirs[k] / ours[k]:.2f}x)"
        for k in ("rollout_s", "update_s")
    )
    same = entry["difference"] is None
    step = theirs["step_s"] / ours["step_s"]
    cpu = theirs["step_cpu_s"] / ours["step_cpu_s"]
    tokens = ours["tokens_per_s"] / theirs["tokens_per_s"]
    memory = ours["peak_rss"] / theirs["peak_rss"]
    return [
        Row(f"step time (TRL / tunelab), {label}", seconds(ours["step_s"]),
            seconds(theirs["step_s"]), f"{step:.2f}x" if same else NOT_COMPARABLE, ">= 1.5x",
            step >= 1.5 if same else None, halves),
        Row(f"step CPU time (TRL / tunelab), {label}", seconds(ours["step_cpu_s"]),
            seconds(theirs["step_cpu_s"]), f"{cpu:.2f}x" if same else NOT_COMPARABLE,
            "-", None, split),
        Row(f"generation tokens/s (tunelab / TRL), {label}", f"{ours['tokens_per_s']:.0f}",
            f"{theirs['tokens_per_s']:.0f}", f"{tokens:.2f}x" if same else NOT_COMPARABLE,
            ">= 1.5x", tokens >= 1.5 if same else None, split),
        Row(f"peak RSS per process (tunelab / TRL), {label}", mebibytes(ours["peak_rss"]),
            mebibytes(theirs["peak_rss"]), f"{memory:.2f}x", "<= 0.9x", memory <= 0.9, split),
    ]  # fmt: skip


def logps_row(args: argparse.Namespace, root: Path) -> Row:
    """The log-prob pass's peak memory at a large vocabulary (issue 26's row)."""
    from _grpo_logps import trl_logps_peak, tunelab_logps_peak
    from _grpo_work import wide_config
    from _models import write_hf_checkpoint

    base = root / "logps"
    write_hf_checkpoint(base, wide_config(args.logps_dim, 2, args.logps_vocab_size))
    figure = (f"log-prob pass peak memory, vocab {args.logps_vocab_size}, "
              f"{args.logps_completion_tokens} completion tokens (tunelab / TRL)")  # fmt: skip
    ours = tunelab_logps_peak(args, base)
    if not trl_installed():
        return Row(figure, mebibytes(ours), NOT_MEASURED, "-", "<= 0.5x", None, ("-", "-"))
    theirs = trl_logps_peak(args, base)
    ratio = ours / theirs
    return Row(figure, mebibytes(ours), mebibytes(theirs), f"{ratio:.2f}x", "<= 0.5x",
               ratio <= 0.5, ("-", "-"))  # fmt: skip


def main() -> None:
    """Orchestrate every launch (or, with ``--worker``, be one process of a launch)."""
    args = parse_args()
    if args.worker == "tunelab":
        from _grpo_tunelab import run

        return run(args)
    if args.worker == "trl":
        from _grpo_trl import run

        return run(args)
    root = Path(args.dir or tempfile.gettempdir()) / "bench_grpo"
    if not args.reuse:
        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    measured = measure(args, root)
    rows = [row for (name, layout), entry in measured.items()
            for row in rows_for(name, layout, entry)]  # fmt: skip
    rows.append(logps_row(args, root))
    if not args.reuse:
        shutil.rmtree(root, ignore_errors=True)
    differences = [f"{name}, {layout}: not the same work ({entry['difference']})"
                   for (name, layout), entry in measured.items() if entry["difference"]]  # fmt: skip
    rounds = "; ".join(
        f"{name} {layout}: step " + ", ".join(
            f"{t['step_s'] / o['step_s']:.2f}x" for o, t in zip(entry["tunelab"], entry["trl"]))
        + ", tokens/s " + ", ".join(
            f"{o['tokens_per_s'] / t['tokens_per_s']:.2f}x"
            for o, t in zip(entry["tunelab"], entry["trl"]))
        + ", step CPU " + ", ".join(
            f"{t['step_cpu_s'] / o['step_cpu_s']:.2f}x"
            for o, t in zip(entry["tunelab"], entry["trl"]))
        for (name, layout), entry in measured.items() if entry["trl"]
    )  # fmt: skip
    print_table(
        "GRPO: tunelab vs TRL GRPOTrainer (fp32, LoRA r=8, DAPO, beta 0)",
        rows,
        notes=[
            f"{args.prompts} prompts x {args.num_generations} completions of exactly "
            f"{args.max_new_tokens} tokens per step (temperature 1, stop tokens unreachable); "
            f"wide = {args.dim} x {args.layers} layers, GQA 12/4 at 768, vocabulary "
            f"{args.vocab_size}; median of {args.steps} timed steps after a warm-up, per step "
            f"the slowest process; each figure the median of {args.rounds} round(s), the sides' "
            "order alternating; split columns: tunelab / TRL (TRL / tunelab)",
            *(differences or (["both sides did the same work (completions, prompt and "
                               "completion tokens) in every step of every round"]
                              if trl_installed() else
                              ["trl not installed: TRL columns not measured (make bench "
                               "installs it)"])),
            *([f"per round: {rounds}"] if rounds else []),
        ],
        extra_columns=["rollout (tunelab / TRL)", "update (tunelab / TRL)"],
    )  # fmt: skip


if __name__ == "__main__":
    main()
