"""Run every benchmark and print their tables (``make bench``).

    python bench/run_all.py                    # the make-bench sizes: minutes on 2 cores
    python bench/run_all.py --full             # the issue's sizes (>= 1 GB models)
    python bench/run_all.py --smoke            # tiny sizes: only checks that the scripts run
    python bench/run_all.py --only export,resume --output results.md

Each benchmark runs in its own processes (2 under torchrun, or 1 and 2 for training), one
after the other, so they never compete with each other for the cores. Their tables go to
stdout as each finishes (and to ``--output`` if given); a benchmark that fails prints the end
of its log, the others still run, and the exit status is 1.
"""

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import launch_env, torchrun  # noqa: E402

# name -> (script, launched under torchrun by this runner, args at make-bench size, --full args);
# --smoke passes each script its own --smoke (its smallest sizes, declared in the script).
BENCHMARKS = {
    "async_save": ("bench_async_save.py", True, [], ["--full"]),
    "export": ("bench_export.py", True, [], ["--size-mb", "1100"]),
    "hf_write": ("bench_hf_write.py", True, ["--size-mb", "256", "--repeats", "5"],
                 ["--size-mb", "1100", "--repeats", "7"]),
    "resume": ("bench_resume.py", True, [], ["--full"]),
    "scale": ("bench_scale.py", True, ["--sizes-mb", "512"], ["--sizes-mb", "512,2048"]),
    "checksum": ("bench_checksum.py", True, ["--repeats", "5"], ["--full"]),
    "data": ("bench_data.py", False, ["--rows", "200000"], ["--rows", "200000"]),
    "streaming": ("bench_streaming.py", False, [], ["--full"]),
    "qlora": ("bench_qlora.py", True, [], ["--size-mb", "1100", "--dim", "2048"]),
    "attention": ("bench_attention.py", False, [], []),
    "context": ("bench_context.py", True, [], []),
    "parallel": ("bench_parallel.py", True, [], ["--seq-len", "8192"]),
    "expert_parallel": ("bench_expert_parallel.py", True, [], ["--tokens", "4096"]),
    "moe": ("bench_moe.py", False, [], ["--tokens", "4096"]),
    "training": ("bench_training.py", False, [],
                 ["--steps", "5", "--seq-len", "512", "--wide-layers", "4"]),
    "grpo": ("bench_grpo.py", False, ["--shapes", "tiny-16,wide-16"], []),
    "grpo_async": ("bench_grpo_async.py", False, [], ["--nprocs", "2,4"]),
    "agentic": ("bench_agentic.py", False, [], ["--rounds", "3", "--steps", "5"]),
    "distill": ("bench_distill.py", False, [], ["--loss-tokens", "4096"]),
    "kto": ("bench_kto.py", False, ["--model", "wide"],
            ["--model", "wide", "--steps", "16", "--batch-size", "16"]),
    "eval": ("bench_eval.py", False, [], []),
    "gguf": ("bench_gguf.py", True, [], ["--size-mb", "1024"]),
    "reward_model": ("bench_reward_model.py", False, ["--model", "wide"],
                     ["--model", "wide", "--steps", "16", "--batch-size", "16"]),
    "vl": ("bench_vl.py", False, [], ["--rounds", "6", "--steps", "16", "--images", "16"]),
    "vl_wide": ("bench_vl.py", False, ["--model", "wide", "--parts", "training", "--rounds", "2"],
                ["--model", "wide", "--parts", "training", "--rounds", "4", "--steps", "16"]),
}  # fmt: skip
SMOKE_ARGS = {"vl_wide": ["--model", "wide", "--parts", "training"]}
"""What a benchmark's ``--smoke`` run takes beside it, where one script backs two entries."""


def machine_summary() -> str:
    """CPU model, core count, memory, OS and library versions, one line each."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (
        f"machine: {model}, {os.cpu_count()} logical CPUs{memory}; {platform.platform()}\n"
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.backends.cpu.get_cpu_capability()} kernels, "
        f"{torch.get_num_threads()} intra-op threads in one process"
    )


def run(name: str, size: str, scratch: str | None) -> tuple[bool, str, float]:
    """Run one benchmark at ``size`` (``bench``, ``full`` or ``smoke``).

    Returns:
        Whether it succeeded, its stdout (the table) or the end of its log, and its seconds.
    """
    script, under_torchrun, bench_args, full_args = BENCHMARKS[name]
    smoke_args = ["--smoke", *SMOKE_ARGS.get(name, [])]
    args = list({"bench": bench_args, "full": full_args, "smoke": smoke_args}[size])
    if scratch is not None:
        args += ["--dir", scratch]
    start = time.perf_counter()
    if under_torchrun:
        done = torchrun(HERE / script, args, 2, capture_output=True, text=True)
    else:
        done = subprocess.run(
            [sys.executable, str(HERE / script), *args],
            capture_output=True,
            text=True,
            env=launch_env(1),
        )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        log = (done.stdout + done.stderr)[-4000:]
        return False, f"\n### {name}: FAILED (exit {done.returncode})\n\n```\n{log}\n```\n", elapsed
    return True, done.stdout, elapsed


def main() -> int:
    """Run the selected benchmarks in order and print their tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--full", action="store_true", help="the issue's sizes (slower)")
    sizes.add_argument("--smoke", action="store_true", help="tiny sizes: checks the scripts run")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated names")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--output", default=None, help="also write the tables to this file")
    args = parser.parse_args()
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}")
    size = "full" if args.full else "smoke" if args.smoke else "bench"
    report = [f"## tunelab benchmarks ({size} sizes)\n",
              machine_summary()]  # fmt: skip
    print("\n".join(report), flush=True)
    failed = []
    total = time.perf_counter()
    for name in names:
        ok, output, elapsed = run(name, size, args.dir)
        heading = "" if "###" in output else f"\n### {name}\n"  # for scripts printing none
        text = heading + output.rstrip() + f"\n\n({name}: {elapsed:.0f} s)"
        print(text, flush=True)
        report.append(text)
        if not ok:
            failed.append(name)
    summary = f"\nall benchmarks: {time.perf_counter() - total:.0f} s" + (
        f"; FAILED: {', '.join(failed)}" if failed else ""
    )
    print(summary, flush=True)
    report.append(summary)
    if args.output:
        Path(args.output).write_text("\n".join(report) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
