"""Agentic GRPO: tunelab's episodes with tools against TRL's ``GRPOTrainer(tools=...)`` (issue 41).

Run (``make bench`` installs trl with the ``bench`` extra):

    python bench/bench_agentic.py                 # builds tiny/agentic_sft's model, 2 rounds
    python bench/bench_agentic.py --model DIR     # an agentic_sft export already made
    python bench/bench_agentic.py --smoke         # the embedded tiny model: checks it runs

The model is the tiny one after ``tiny/agentic_sft`` (it calls the calculator in about half of
its episodes; built here in about 2 minutes on 2 processes unless ``--model`` names it), with
the tiny tools chat template: turns in ``<|im_start|>...<|im_end|>`` and calls written as
``<tool_call>{json}</tool_call>``, the Qwen 2.5 / Qwen3 layout TRL's Qwen3 response parser
reads. Each step: ``--prompts`` prompts of ``calculator_prompts.jsonl`` ("What is a + b?") x
``--num-generations`` episodes, greedy (both sides then sample the same tokens: checked), the
calculator as the one tool, ``--max-turns`` replies (TRL: ``max_tool_calling_iterations`` one
less), ``--max-episode-tokens`` after the prompt (TRL: ``max_completion_length``), LoRA r=8,
DAPO token-mean loss, beta 0, one iteration. Sides: ``_agentic_sides``.

Each launch is one side in a fresh process (1 process, ``--threads`` threads): 1 warm-up step,
then ``--steps`` timed steps. ``--rounds`` rounds, the order alternating. Before a ratio is
printed, every step's episodes (their token ids after the prompt) are compared: where they
differ the table says so and gives no ratio. Rows: step time (wall; CPU seconds beside it),
generation tokens/s (the policy's tokens over the generation time; per CPU second beside it:
on a loaded machine the wall figures swing, the CPU ones much less; the tool worker process's
CPU, microseconds of arithmetic per call, is not in tunelab's figure; ``met`` needs both the
wall and the CPU ratio), prefilled tokens per
episode (tunelab keeps the KV cache across turns; TRL's ``generate`` takes the conversation
again each turn). Targets (issue 41): step time and generation tokens/s at least 1.5x TRL's,
prefill tokens per episode at most 0.5x. Without trl, no TRL column.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import Row, parse_bench_args, print_table, seconds

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TINY = ROOT / "framework" / "tunelab" / "assets" / "tiny"
NOT_COMPARABLE = "none: not the same work"


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a tiny/agentic_sft export (default: build one)")
    parser.add_argument("--base", action="store_true", help="the embedded tiny model, not SFT'd")
    parser.add_argument("--rounds", type=int, default=2, help="side pairs, order alternating")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after a warm-up)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-episode-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="per side (1: CPU time is robust)")
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    smoke = ["--base", "--rounds", "1", "--steps", "1", "--prompts", "2",
             "--num-generations", "2", "--max-episode-tokens", "16"]  # fmt: skip
    return parse_bench_args(parser, smoke)


def model_dir(args: argparse.Namespace, root: Path) -> Path:
    """The policy's folder: ``--model``, the embedded tiny model, or tiny/agentic_sft built here."""
    if args.model:
        return Path(args.model)
    if args.base:
        return TINY
    out = root / "agentic_sft"
    if not (out / "epoch_4" / "config.json").exists():
        command = [
            str(Path(sys.executable).parent / "tunelab"), "run", "--nproc_per_node", "2",
            "full_finetune_distributed", "--config", "tiny/agentic_sft", f"output_dir={out}",
            "checkpoint.enable_async_checkpointing=false",
        ]  # fmt: skip
        print("building tiny/agentic_sft's model (about 2 minutes) ...", flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit("bench_agentic: tiny/agentic_sft failed")
    return out / "epoch_4"


def launch(side: str, setup: Path, result: Path, threads: int) -> dict:
    """One side in a fresh process; its result file."""
    env = dict(os.environ) | {
        "OMP_NUM_THREADS": str(threads),
        "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    command = [sys.executable, str(HERE / "_agentic_sides.py"), side, str(setup), str(result)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=HERE)
    if done.returncode != 0 or not result.exists():
        sys.stderr.write((done.stdout + done.stderr)[-6000:])
        raise SystemExit(f"bench_agentic: the {side} launch failed")
    return json.loads(result.read_text())


def work_difference(ours: list, theirs: list) -> str | None:
    """The first difference between two sides' episodes, in words; None when the same."""
    if len(ours) != len(theirs):
        return f"tunelab ran {len(ours)} steps, TRL {len(theirs)}"
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if len(a) != len(b):
            return f"step {step}: {len(a)} episodes against {len(b)}"
        for episode, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                at = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
                return (
                    f"step {step}, episode {episode} (sorted): {len(x)} against {len(y)} tokens, "
                    f"first difference at token {at}"
                )
    return None


def figures(result: dict) -> dict[str, float]:
    """One launch's medians over its timed steps (the warm-up left out)."""
    timed = result["steps"][1:]
    out = {key: statistics.median(s[key] for s in timed) for key in ("step_s", "step_cpu_s")}
    generated = sum(s["generated"] for s in timed)
    out["tokens_per_s"] = generated / sum(s["generate_s"] for s in timed)
    out["tokens_per_cpu_s"] = generated / sum(s["generate_cpu_s"] for s in timed)
    episodes = sum(len(step) for step in result["work"][1:])
    out["prefill_per_episode"] = sum(s["prefilled"] for s in timed) / episodes
    out["tool_calls"] = result["tool_calls"]
    return out


def main() -> None:
    """Prepare, run the rounds, print the table."""
    args = parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_agentic_"))
    root.mkdir(parents=True, exist_ok=True)
    prompts_file = TINY / "calculator_prompts.jsonl"
    rows = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    needed = (1 + args.steps) * args.prompts
    if needed > len(rows):
        raise SystemExit(
            f"--steps and --prompts need {needed} prompts; {prompts_file} has {len(rows)}"
        )
    setup = {
        "model": str(model_dir(args, root)),
        "chat_template": str(TINY / "tools_chat_template.jinja"),
        "prompts": [row["prompt"] for row in rows[:needed]],
        "prompts_per_step": args.prompts,
        "steps": args.steps,
        "num_generations": args.num_generations,
        "max_turns": args.max_turns,
        "max_episode_tokens": args.max_episode_tokens,
    }
    setup_file = root / "setup.json"
    setup_file.write_text(json.dumps(setup))
    sides = ["tunelab", "trl"] if importlib.util.find_spec("trl") else ["tunelab"]
    measured: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    difference = None
    load = []
    for round_index in range(args.rounds):
        results = {}
        for side in sides if round_index % 2 == 0 else sides[::-1]:
            load.append(os.getloadavg()[0])
            results[side] = launch(
                side, setup_file, root / f"{side}_{round_index}.json", args.threads
            )
            measured[side].append(figures(results[side]))
        if "trl" in results and difference is None:
            difference = work_difference(results["tunelab"]["work"], results["trl"]["work"])
            difference = difference and f"round {round_index}: {difference}"
    print_table(
        "Agentic GRPO step: tunelab vs TRL GRPOTrainer(tools=...)",
        table_rows(measured, difference),
        notes_for(args, setup, measured, difference, load),
    )
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


def table_rows(measured: dict[str, list[dict[str, float]]], difference: str | None) -> list[Row]:
    """Step time, generation tokens/s and prefill per episode, medians over rounds of ratios."""
    ours = measured["tunelab"]
    median = lambda key, side: statistics.median(r[key] for r in side)  # noqa: E731
    if "trl" not in measured:
        return [Row("step time", seconds(median("step_s", ours)), "not measured", "-",
                    ">= 1.5x", None)]  # fmt: skip
    theirs = measured["trl"]
    same = difference is None

    def ratio(key: str, inverse: bool) -> float:
        pairs = [(t[key] / o[key]) if inverse else (o[key] / t[key]) for o, t in zip(ours, theirs)]
        return statistics.median(pairs)

    step, step_cpu = ratio("step_s", True), ratio("step_cpu_s", True)
    tokens, prefill = ratio("tokens_per_s", False), ratio("prefill_per_episode", False)
    tokens_cpu = ratio("tokens_per_cpu_s", False)
    shown = lambda value: f"{value:.2f}x" if same else NOT_COMPARABLE  # noqa: E731
    return [
        Row("step time (TRL / tunelab; CPU s in brackets)",
            f"{seconds(median('step_s', ours))} ({median('step_cpu_s', ours):.2f} CPU s)",
            f"{seconds(median('step_s', theirs))} ({median('step_cpu_s', theirs):.2f} CPU s)",
            f"{shown(step)} ({step_cpu:.2f}x CPU)" if same else NOT_COMPARABLE, ">= 1.5x",
            min(step, step_cpu) >= 1.5 if same else None),
        Row("generation tokens/s (tunelab / TRL; per CPU s in brackets)",
            f"{median('tokens_per_s', ours):.0f} ({median('tokens_per_cpu_s', ours):.0f})",
            f"{median('tokens_per_s', theirs):.0f} ({median('tokens_per_cpu_s', theirs):.0f})",
            f"{shown(tokens)} ({tokens_cpu:.2f}x CPU)" if same else NOT_COMPARABLE, ">= 1.5x",
            min(tokens, tokens_cpu) >= 1.5 if same else None),
        Row("prefilled tokens per episode (tunelab / TRL)",
            f"{median('prefill_per_episode', ours):.1f}",
            f"{median('prefill_per_episode', theirs):.1f}", shown(prefill), "<= 0.5x",
            prefill <= 0.5 if same else None),
    ]  # fmt: skip


def notes_for(args, setup, measured, difference, load) -> list[str]:
    """The settings, each round's figures, the work check and the load."""
    notes = [
        f"Model {setup['model']}; {args.prompts} prompts x {args.num_generations} episodes per "
        f"step, greedy, {args.max_turns} turns, {args.max_episode_tokens} episode tokens, "
        f"{args.steps} timed steps after 1 warm-up, 1 process x {args.threads} threads per side, "
        f"{args.rounds} rounds (order alternating). Load average before each launch: "
        + ", ".join(f"{value:.1f}" for value in load)
        + ".",
        "Same work: "
        + (
            "every step's episodes are token-identical."
            if difference is None
            else f"NO ({difference}): no ratio is given."
        ),  # fmt: skip
    ]
    for index, (ours, theirs) in enumerate(zip(measured["tunelab"], measured.get("trl", []))):
        notes.append(
            f"Round {index}: step {ours['step_s']:.3f} / {theirs['step_s']:.3f} s "
            f"(CPU {ours['step_cpu_s']:.2f} / {theirs['step_cpu_s']:.2f} s), generation "
            f"{ours['tokens_per_s']:.0f} / {theirs['tokens_per_s']:.0f} tokens/s "
            f"({ours['tokens_per_cpu_s']:.0f} / {theirs['tokens_per_cpu_s']:.0f} per CPU s), prefill per "
            f"episode {ours['prefill_per_episode']:.1f} / {theirs['prefill_per_episode']:.1f}, "
            f"tool calls {ours['tool_calls']:.0f} / {theirs['tool_calls']:.0f} (tunelab / TRL)."
        )
    return notes


if __name__ == "__main__":
    main()
