"""Preparing a chat dataset on 2 ranks: tokenized in every rank (before) vs once per machine.

Run (it launches torchrun itself, once per mode, 2 processes each):

    python bench/bench_data.py                  # 200k synthetic chat rows
    python bench/bench_data.py --smoke          # its smallest size: checks it runs

The rows are synthetic conversations (1 or 2 user / assistant turns, some with a system
message) written as JSON Lines into a temporary folder, rendered with the embedded tiny
tokenizer's own chat template (``chat_dataset``, ``template: auto``, ``max_seq_len`` 256).
Three launches, one after the other, each timed from a barrier after the imports:

- before: what each rank did until this change, reproduced here: read the whole file with
  ``json`` into a list of rows, tokenize every row in the rank's own process with the same
  row function ``chat_dataset`` uses, and hold every sample as Python lists.
- after: ``chat_dataset`` into a fresh cache: local rank 0 tokenizes with ``num_proc`` worker
  processes (default ``min(8, cpu count)``) into the ``datasets`` cache; rank 1 waits in one
  collective; both then memory-map the Arrow table.
- after, warm: the same call in a new launch (a restart, or the next run on the data).

Figures: the peak resident set of each rank while preparing (``VmHWM``; it includes the
imports both modes share, given as the baseline), the CPU time (user + system) of every
process that worked (both ranks and, after, rank 0's tokenizing workers), and the wall time
of the slowest rank. Targets: after uses less peak memory per rank and less total CPU time
than before. Absolute figures depend on the machine and its load; the ratios are the claim.
"""

import argparse
import json
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import MiB, Row, barrier, parse_bench_args, print_table, torchrun
from _system import peak_rss_bytes, release_free_memory, reset_peak_rss, rss_bytes

MODES = ("before", "after", "warm")
MAX_SEQ_LEN = 256
WORDS = "red cat sun car bus cow star tree blue green one two three lamp door map".split()


def parse_args() -> argparse.Namespace:
    """Command-line flags (the orchestrator's, plus the worker's own)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="synthetic chat rows")
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizing workers (after)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per launch")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    # Smoke: 1 rank per launch (the 2-rank wait is run by tests/recipes/test_data_once_per_machine).
    return parse_bench_args(parser, smoke=["--rows", "200", "--nproc", "1"])


def write_rows(path: Path, num_rows: int) -> None:
    """Synthetic conversations, seeded: the same file for every mode."""
    rng = random.Random(0)
    with path.open("w") as out:
        for _ in range(num_rows):
            messages = []
            if rng.random() < 0.3:
                messages.append({"role": "system", "content": "Answer in as few words as you can."})
            for _ in range(rng.randint(1, 2)):
                words = [rng.choice(WORDS) for _ in range(rng.randint(3, 10))]
                messages.append(
                    {"role": "user", "content": "Reverse the words: " + " ".join(words)}
                )
                messages.append({"role": "assistant", "content": " ".join(reversed(words))})
            out.write(json.dumps({"messages": messages}) + "\n")


def prepare_before(tokenizer, path: Path) -> list[dict]:
    """The per-rank path before this change: the whole file read and tokenized in this rank.

    ``sources._read_json`` read the text, tried it as one JSON document, then parsed it line by
    line into a list of rows; ``rows.build_samples`` turned each row into samples held as
    Python lists (``TokenizedDataset(items)``). The row function is the one ``chat_dataset``
    uses today, so both modes do the same tokenizing work per row.
    """
    from tunelab.data.chat import chat_template_of
    from tunelab.data.conversations import ChatRows
    from tunelab.data.rows import Render

    text = path.read_text(encoding="utf-8")
    try:
        json.loads(text)
    except json.JSONDecodeError:
        pass  # not one document: JSON Lines
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    del text
    render = Render(tokenizer, chat_template_of(tokenizer), None, False, MAX_SEQ_LEN)
    make = ChatRows(render, "messages", "openai")
    samples = []
    for row in rows:
        for sample in make(row):
            samples.append({"tokens": sample["tokens"], "labels": sample["labels"]})
    return samples


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) of this process, and of its finished children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def worker(args: argparse.Namespace) -> None:
    """One rank: prepare the dataset in ``args.worker`` mode and write its figures."""
    import torch.distributed as dist

    from tunelab._paths import assets_dir
    from tunelab.data import chat_dataset, load_tokenizer
    from tunelab.distributed import destroy_distributed, init_distributed

    info = init_distributed("cpu")
    tokenizer = load_tokenizer(assets_dir() / "tiny", max_seq_len=MAX_SEQ_LEN)
    import datasets  # noqa: F401 - both modes start with the same libraries loaded

    release_free_memory()
    barrier()
    baseline = rss_bytes()
    reset_peak_rss()
    own_start, children_start = cpu_seconds()
    start = time.perf_counter()
    if args.worker == "before":
        dataset = prepare_before(tokenizer, Path(args.data))
    else:
        dataset = chat_dataset(
            tokenizer,
            source=args.data,
            max_seq_len=MAX_SEQ_LEN,
            num_proc=args.num_proc,
            cache_dir=args.cache,
        )
    first, last = dataset[0], dataset[len(dataset) - 1]  # the items are readable
    elapsed = time.perf_counter() - start
    own_end, children_end = cpu_seconds()
    result = {
        "rank": info.rank,
        "items": len(dataset),
        "check": [len(first["tokens"]), len(last["tokens"])],
        "seconds": elapsed,
        "cpu": own_end - own_start,
        "children_cpu": children_end - children_start,
        "baseline_rss": baseline,
        "peak_rss": peak_rss_bytes(),
        "largest_child_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    }
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if info.rank == 0:
        Path(args.result).write_text(json.dumps(results))
    destroy_distributed()


def launch(mode: str, args: argparse.Namespace, data: Path, cache: Path, out: Path) -> list:
    """Run one mode under torchrun (``--nproc`` processes); return every rank's figures."""
    result = out / f"{mode}.json"
    extra = ["--num-proc", str(args.num_proc)] if args.num_proc else []
    done = torchrun(
        Path(__file__),
        ["--worker", mode, "--data", str(data), "--cache", str(cache), "--result", str(result),
         *extra],
        args.nproc,
        capture_output=True,
        text=True,
    )  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"{mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(result.read_text())


def main() -> None:
    """Write the rows, run the three modes one after the other, print the table."""
    args = parse_args()
    if args.worker:
        worker(args)
        return
    root = Path(tempfile.mkdtemp(prefix="tunelab_bench_data_", dir=args.dir))
    try:
        data = root / "chat.jsonl"
        write_rows(data, args.rows)
        runs = {mode: launch(mode, args, data, root / "cache", root) for mode in MODES}
        cache_bytes = sum(f.stat().st_size for f in (root / "cache").rglob("*") if f.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(args, runs, cache_bytes)


def report(args: argparse.Namespace, runs: dict, cache_bytes: int) -> None:
    """Print the table of the three runs."""
    before, after, warm = (runs[mode] for mode in MODES)
    assert [r["items"] for r in before] == [r["items"] for r in after] == [r["items"] for r in warm]

    def peak(run: list) -> int:
        return max(r["peak_rss"] for r in run)

    def cpu(run: list) -> float:
        return sum(r["cpu"] + r["children_cpu"] for r in run)

    def wall(run: list) -> float:
        return max(r["seconds"] for r in run)

    def mib(value: float) -> str:
        return f"{value / MiB:.0f} MiB"

    rows = [
        Row("peak RSS per rank (the larger rank)", mib(peak(after)), mib(peak(before)),
            f"{peak(after) / peak(before):.2f}x", "< 1x", peak(after) < peak(before)),
        Row("CPU time, every process", f"{cpu(after):.1f} s", f"{cpu(before):.1f} s",
            f"{cpu(after) / cpu(before):.2f}x", "< 1x", cpu(after) < cpu(before)),
        Row("wall time, slowest rank", f"{wall(after):.1f} s", f"{wall(before):.1f} s",
            f"{wall(after) / wall(before):.2f}x", "-", None),
        Row("wall time, warm cache (next run)", f"{wall(warm):.1f} s", f"{wall(before):.1f} s",
            f"{wall(warm) / wall(before):.2f}x", "-", None),
        Row("peak RSS per rank, warm cache", mib(peak(warm)), mib(peak(before)),
            f"{peak(warm) / peak(before):.2f}x", "-", None),
    ]  # fmt: skip
    per_rank = "; ".join(
        f"{mode}: " + ", ".join(
            f"rank {r['rank']} {mib(r['peak_rss'])} peak, {r['cpu']:.1f} s CPU"
            + (f" + workers {r['children_cpu']:.1f} s" if r["children_cpu"] > 0.05 else "")
            for r in run
        )
        for mode, run in runs.items()
    )  # fmt: skip
    workers = max(r["largest_child_rss"] for r in after)
    worker_note = (
        f"After: rank 0's largest tokenizing worker peaked at {mib(workers)} RSS (forked from "
        "rank 0, so most of its pages are rank 0's, shared)."
        if workers
        else "After: rank 0 tokenized in its own process (too few rows for worker processes)."
    )
    notes = [
        f"{args.rows} synthetic chat rows, {before[0]['items']} samples; {args.nproc} rank(s) under "
        "torchrun; "
        f"baseline RSS after imports {mib(before[0]['baseline_rss'])} (in both modes).",
        f"Per rank: {per_rank}.",
        f"{worker_note} The tokenized cache holds {mib(cache_bytes)} of Arrow files, "
        "memory-mapped by every rank and shared through the page cache.",
    ]
    print_table(f"data: tokenizing once per machine ({args.nproc} ranks)", rows, notes)


if __name__ == "__main__":
    main()
