"""Streaming (``streaming: true``): peak memory against corpus size, throughput against the
materialised path.

Run (each figure in its own process, one after the other):

    python bench/bench_streaming.py                   # corpora of 100 MB and 400 MB
    python bench/bench_streaming.py --full            # the issue's 1 GB and 4 GB
    python bench/bench_streaming.py --smoke           # its smallest sizes: checks it runs
    python bench/bench_streaming.py --only ranks --before OLD/framework  # the 2-rank rows only

The corpus is synthetic plain text (rows of 150 words) in JSON Lines shards of 1000 rows
(about 0.7 MB each), read with ``text_dataset`` (``packed: true``, ``max_seq_len`` 512, the
embedded tiny tokenizer). Three kinds of process:

- stream: one whole pass of ``StreamingDataset.items`` (read, shuffle window, tokenize, pack)
  over each corpus; its peak RSS (``VmHWM``, imports included, plus the peak of its one
  DataLoader worker, which shares most of its pages: an upper bound) must not grow with the
  corpus: target within 10% between the two sizes.
- materialised: ``text_dataset`` without streaming into a fresh cache (tokenized once,
  ``num_proc`` 1, as the streamed pass uses one process) and then every pack read once: what
  the first epoch of a run costs the map-style path. The target compares the median of
  ``--repeats`` interleaved passes of each over a ``--time-mb`` corpus (20 MB): the streamed
  pass within 10% of the materialised one. Both are also run once on the smaller corpus (the
  first timed passes, when ``--time-mb`` is its size, as in ``--smoke``).
- ranks: one pass of the stream on 2 gloo ranks (torchrun) over a ``--ranks-mb`` corpus (10 MB):
  the characters each rank hands to ``json.loads`` (counted by wrapping it, in the rank and in
  its DataLoader workers, which share the counter), and the pass time of the slower rank, bare
  and with a simulated training step (``--step-ms`` of sleep per round of 8 packs, 4 per rank:
  the data work of the next windows can overlap it). With ``--before DIR`` (the ``framework``
  folder of an earlier checkout) the same passes run on that code too, interleaved with this
  code's (before, after, before, after, ...), and the medians are compared.

Absolute figures depend on the machine and its load; the ratios are the claim.
"""

import argparse
import json
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import MiB, Row, launch_env, parse_bench_args, print_table
from _system import peak_rss_bytes

MAX_SEQ_LEN = 512
ROWS_PER_SHARD = 1000
WORDS = "red cat sun car bus cow star tree blue green one two three lamp door map".split()


def parse_args() -> argparse.Namespace:
    """Command-line flags (the orchestrator's, plus the worker's own)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs=2, default=[100, 400])
    parser.add_argument("--full", action="store_true", help="the issue's 1 GB and 4 GB")
    parser.add_argument("--time-mb", type=float, default=20, help="corpus of the timed passes")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of each path")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--only", choices=("ranks",), help="only the 2-rank passes")
    parser.add_argument("--ranks-mb", type=float, default=10, help="corpus of the 2-rank passes")
    parser.add_argument("--step-ms", type=float, default=4, help="simulated step per 8 packs")
    parser.add_argument("--before", help="framework folder of an earlier checkout to compare")
    parser.add_argument(
        "--worker", choices=("stream", "materialised", "ranks"), help=argparse.SUPPRESS
    )
    parser.add_argument("--data", help=argparse.SUPPRESS)
    # Smoke: the timed passes serve the small corpus's rows too (the same size), and one
    # 2-rank launch (no simulated step): 3 single processes and 1 torchrun launch.
    smoke = ["--sizes-mb", "1", "2", "--time-mb", "1", "--repeats", "1", "--ranks-mb", "1",
             "--step-ms", "0"]  # fmt: skip
    return parse_bench_args(parser, smoke)


def write_corpus(folder: Path, size_mb: float) -> tuple[int, int]:
    """JSONL shards of synthetic text, seeded, up to ``size_mb``; return (bytes, shards)."""
    folder.mkdir(parents=True)
    rng = random.Random(0)
    written = shards = 0
    while written < size_mb * MiB:
        with (folder / f"part-{shards:05d}.jsonl").open("w") as out:
            for _ in range(ROWS_PER_SHARD):
                line = json.dumps({"text": " ".join(rng.choices(WORDS, k=150))}) + "\n"
                out.write(line)
                written += len(line)
        shards += 1
    return written, shards


def worker(args: argparse.Namespace) -> None:
    """One pass over ``args.data`` as ``args.worker``; print its figures as JSON."""
    from tunelab._paths import assets_dir
    from tunelab.data import load_tokenizer, text_dataset
    from tunelab.data.streaming import start_location

    tokenizer = load_tokenizer(assets_dir() / "tiny", max_seq_len=MAX_SEQ_LEN)
    import datasets  # noqa: F401 - both modes start with the same libraries loaded

    start = time.perf_counter()
    settings = {"source": args.data, "max_seq_len": MAX_SEQ_LEN, "packed": True}
    if args.worker == "stream":
        dataset = text_dataset(tokenizer, **settings, streaming=True)
        items = sum(1 for _ in dataset.items(0, 0, start_location()))
    else:
        cache = Path(args.data).parent / "cache"
        dataset = text_dataset(tokenizer, **settings, cache_dir=str(cache), num_proc=1)
        items = sum(1 for index in range(len(dataset)) if dataset[index])
    seconds = time.perf_counter() - start
    # The stream's DataLoader worker has exited (joined) by now: add its peak, counting the
    # pages it shares with this process twice (an upper bound).
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    peak_rss = peak_rss_bytes() + children
    print(json.dumps({"items": items, "seconds": seconds, "peak_rss": peak_rss}))


ROUND = 8  # packs per simulated step over the 2 ranks (batch_size 4 each)


def ranks_worker(args: argparse.Namespace) -> None:
    """One rank of a 2-rank pass (under torchrun); rank 0 prints every rank's figures."""
    import multiprocessing

    import torch.distributed as dist

    from tunelab._paths import assets_dir
    from tunelab.data import load_tokenizer, text_dataset
    from tunelab.data.streaming import start_location

    dist.init_process_group("gloo")
    tokenizer = load_tokenizer(assets_dir() / "tiny", max_seq_len=MAX_SEQ_LEN)
    import datasets  # noqa: F401 - both versions start with the same libraries loaded

    # Shared memory: the DataLoader workers a rank forks add to its count.
    parsed = multiprocessing.RawValue("q", 0)
    loads = json.loads

    def counting_loads(text, *args, **kwargs):
        parsed.value += len(text)
        return loads(text, *args, **kwargs)

    json.loads = counting_loads
    dist.barrier()
    start = time.perf_counter()
    dataset = text_dataset(
        tokenizer, source=args.data, max_seq_len=MAX_SEQ_LEN, packed=True, streaming=True
    )
    items = 0
    for _ in dataset.items(0, 0, start_location()):
        items += 1
        if args.step_ms and items % ROUND == 0:
            time.sleep(args.step_ms / 1000)
    seconds = time.perf_counter() - start
    json.loads = loads
    figures = {"items": items, "seconds": seconds, "parsed": parsed.value}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if dist.get_rank() == 0:
        print(json.dumps(gathered))
    dist.destroy_process_group()


def launch_ranks(data: Path, framework: str, step_ms: float) -> dict:
    """A 2-rank pass on the code in ``framework``; the slower rank's time, each rank's parse."""
    from _common import free_port

    env = {**launch_env(2), "PYTHONPATH": framework}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master-port", str(free_port()), __file__, "--worker", "ranks", "--data", str(data),
        "--step-ms", str(step_ms),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"ranks failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    ranks = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "seconds": max(rank["seconds"] for rank in ranks),
        "parsed": max(rank["parsed"] for rank in ranks),
        "items": ranks[0]["items"],
    }


def ranks_rows(args: argparse.Namespace, root: Path) -> tuple[list[Row], list[str]]:
    """The 2-rank rows: this code against ``--before`` (or the corpus alone)."""
    data = root / "ranks" / "data"
    corpus, shards = write_corpus(data, args.ranks_mb)
    here = str(Path(__file__).resolve().parent.parent / "framework")
    codes = {"after": here, **({"before": args.before} if args.before else {})}
    steps_ms = sorted({0, args.step_ms})  # bare, and with the simulated step when there is one
    runs: dict[tuple[str, float], list[dict]] = {}
    for _ in range(args.repeats):
        for step_ms in steps_ms:
            for name in sorted(codes, reverse=True) if len(codes) > 1 else codes:  # before first
                runs.setdefault((name, step_ms), []).append(
                    launch_ranks(data, codes[name], step_ms)
                )
    first_shard = (data / "part-00000.jsonl").stat().st_size
    shutil.rmtree(root / "ranks")

    def median(name: str, step_ms: float, key: str) -> float:
        return statistics.median(run[key] for run in runs[(name, step_ms)])

    def each(name: str, step_ms: float) -> str:
        return ", ".join(f"{run['seconds']:.1f}" for run in runs[(name, step_ms)])

    parsed = median("after", 0, "parsed")
    rows = []
    if "before" in codes:
        assert {run["items"] for run in runs[("after", 0)] + runs[("before", 0)]} == {
            runs[("after", 0)][0]["items"]
        }
        parsed_before = median("before", 0, "parsed")
        rows.append(Row(
            f"JSON parsed per rank, 2 ranks over {corpus / MiB:.0f} MB: after vs before",
            f"{parsed / MiB:.1f} MB", f"{parsed_before / MiB:.1f} MB",
            f"{parsed / parsed_before:.2f}x", "-", None,
        ))  # fmt: skip
        for step_ms in steps_ms:
            after, before = (
                median("after", step_ms, "seconds"),
                median("before", step_ms, "seconds"),
            )
            what = "bare" if not step_ms else f"with a {step_ms:g} ms step per {ROUND} packs"
            rows.append(Row(
                f"2-rank pass, {what} (median of {args.repeats}): after vs before",
                f"{after:.1f} s", f"{before:.1f} s", f"{after / before:.2f}x", "-", None,
            ))  # fmt: skip
    else:
        # A rank's half of every line, and its half of the first window once more (the
        # tokenizer fit check reads it when the dataset is built); a window is one shard here.
        share = (corpus + first_shard) / 2
        rows.append(Row(
            f"JSON parsed per rank, 2 ranks over {corpus / MiB:.0f} MB: vs half the corpus "
            "and half its first window", f"{parsed / MiB:.2f} MB", f"{share / MiB:.2f} MB",
            f"{parsed / share:.2f}x", "<= 1.05x", parsed / share <= 1.05,
        ))  # fmt: skip
    notes = [
        f"2-rank passes: {shards} JSONL shards, {runs[('after', 0)][0]['items']} packs; "
        + "; ".join(
            f"{name}, step {step_ms:g} ms: {each(name, step_ms)} s" for name, step_ms in runs
        )
        + f". {args.step_ms:g} ms of sleep per {ROUND} packs stands for a training step."
    ]
    return rows, notes


def launch(mode: str, data: Path) -> dict:
    """Run one worker process; return its figures."""
    done = subprocess.run(
        [sys.executable, __file__, "--worker", mode, "--data", str(data)],
        capture_output=True, text=True, env=launch_env(1),
    )  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"{mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Write both corpora, run the passes one after the other, print the table."""
    args = parse_args()
    if args.worker == "ranks":
        ranks_worker(args)
        return
    if args.worker:
        worker(args)
        return
    small_mb, large_mb = (1024, 4096) if args.full else args.sizes_mb
    root = Path(tempfile.mkdtemp(prefix="tunelab_bench_streaming_", dir=args.dir))
    if args.only == "ranks":
        try:
            rows, notes = ranks_rows(args, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print_table("streaming: each rank's share", rows, notes)
        return
    try:
        rank_rows, rank_notes = ranks_rows(args, root)
        # Timed passes on a smaller corpus, interleaved (A, B, A, B, ...) so a burst of load
        # hits both paths alike; the median of each.
        timed = root / "timed" / "data"
        timed_bytes, timed_shards = write_corpus(timed, args.time_mb)
        passes: dict[str, list[dict]] = {"stream": [], "materialised": []}
        for _ in range(args.repeats):
            for mode, runs in passes.items():
                shutil.rmtree(timed.parent / "cache", ignore_errors=True)
                runs.append(launch(mode, timed))
        shutil.rmtree(root / "timed")
        if args.time_mb == small_mb:  # the same corpus (seeded): its first passes serve
            small_bytes, small_shards = timed_bytes, timed_shards
            stream_small, materialised = passes["stream"][0], passes["materialised"][0]
        else:
            small = root / "small" / "data"
            small_bytes, small_shards = write_corpus(small, small_mb)
            stream_small = launch("stream", small)
            materialised = launch("materialised", small)
            shutil.rmtree(root / "small")
        large = root / "large" / "data"
        large_bytes, large_shards = write_corpus(large, large_mb)
        stream_large = launch("stream", large)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert stream_small["items"] == materialised["items"]
    rss_ratio = stream_large["peak_rss"] / stream_small["peak_rss"]
    stream_time = statistics.median(run["seconds"] for run in passes["stream"])
    materialised_time = statistics.median(run["seconds"] for run in passes["materialised"])
    time_ratio = stream_time / materialised_time

    def mib(value: float) -> str:
        return f"{value / MiB:.0f} MiB"

    def times(mode: str) -> str:
        return ", ".join(f"{run['seconds']:.1f}" for run in passes[mode])

    def rate(run: dict, size: int) -> str:
        return f"{size / MiB / run['seconds']:.2f} MB/s"

    rows = [
        Row(f"peak RSS, stream of {large_bytes / MiB:.0f} MB vs {small_bytes / MiB:.0f} MB",
            mib(stream_large["peak_rss"]), mib(stream_small["peak_rss"]), f"{rss_ratio:.2f}x",
            "<= 1.10x", rss_ratio <= 1.10),
        Row(f"one pass over {timed_bytes / MiB:.0f} MB: stream vs materialised (median of "
            f"{args.repeats})", f"{stream_time:.1f} s", f"{materialised_time:.1f} s",
            f"{time_ratio:.2f}x", "<= 1.10x", time_ratio <= 1.10),
        Row(f"one pass over {small_bytes / MiB:.0f} MB: stream vs materialised (once)",
            f"{stream_small['seconds']:.1f} s", f"{materialised['seconds']:.1f} s",
            f"{stream_small['seconds'] / materialised['seconds']:.2f}x", "-", None),
        Row(f"peak RSS on {small_bytes / MiB:.0f} MB: stream vs materialised",
            mib(stream_small["peak_rss"]), mib(materialised["peak_rss"]),
            f"{stream_small['peak_rss'] / materialised['peak_rss']:.2f}x", "-", None),
    ]  # fmt: skip
    notes = [
        f"Corpora: {small_shards} and {large_shards} JSONL shards of {ROWS_PER_SHARD} rows; "
        f"{stream_small['items']} and {stream_large['items']} packs of {MAX_SEQ_LEN} tokens. "
        f"Stream: {rate(stream_small, small_bytes)} and {rate(stream_large, large_bytes)}; "
        f"materialised (tokenize into the cache with 1 process, then read every pack): "
        f"{rate(materialised, small_bytes)}. Timed passes: stream {times('stream')} s, "
        f"materialised {times('materialised')} s. "
        "Peak RSS includes the imports (torch, datasets).",
    ]
    print_table(
        "streaming: memory against corpus size, time against the cache, each rank's share",
        rows + rank_rows, notes + rank_notes,
    )  # fmt: skip


if __name__ == "__main__":
    main()
