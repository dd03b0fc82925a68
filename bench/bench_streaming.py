"""Streaming (``streaming: true``): peak memory against corpus size, throughput against the
materialised path.

Run (each figure in its own process, one after the other):

    python bench/bench_streaming.py                   # corpora of 100 MB and 400 MB
    python bench/bench_streaming.py --full            # the issue's 1 GB and 4 GB
    python bench/bench_streaming.py --sizes-mb 4 16   # a smoke size

The corpus is synthetic plain text (rows of 150 words) in JSON Lines shards of 1000 rows
(about 0.7 MB each), read with ``text_dataset`` (``packed: true``, ``max_seq_len`` 512, the
embedded tiny tokenizer). Three kinds of process:

- stream: one whole pass of ``StreamingDataset.items`` (read, shuffle window, tokenize, pack)
  over each corpus; its peak RSS (``VmHWM``, imports included) must not grow with the corpus:
  target within 10% between the two sizes.
- materialised: ``text_dataset`` without streaming into a fresh cache (tokenized once,
  ``num_proc`` 1, as the streamed pass uses one process) and then every pack read once: what
  the first epoch of a run costs the map-style path. The target compares the median of
  ``--repeats`` interleaved passes of each over a ``--time-mb`` corpus (20 MB): the streamed
  pass within 10% of the materialised one. Both are also run once on the smaller corpus.

Absolute figures depend on the machine and its load; the ratios are the claim.
"""

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import MiB, Row, launch_env, print_table
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
    parser.add_argument("--worker", choices=("stream", "materialised"), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    return parser.parse_args()


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
    print(json.dumps({"items": items, "seconds": seconds, "peak_rss": peak_rss_bytes()}))


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
    if args.worker:
        worker(args)
        return
    small_mb, large_mb = (1024, 4096) if args.full else args.sizes_mb
    root = Path(tempfile.mkdtemp(prefix="tunelab_bench_streaming_", dir=args.dir))
    try:
        # Timed passes on a smaller corpus, interleaved (A, B, A, B, ...) so a burst of load
        # hits both paths alike; the median of each.
        timed = root / "timed" / "data"
        timed_bytes, _ = write_corpus(timed, args.time_mb)
        passes: dict[str, list[dict]] = {"stream": [], "materialised": []}
        for _ in range(args.repeats):
            for mode, runs in passes.items():
                shutil.rmtree(timed.parent / "cache", ignore_errors=True)
                runs.append(launch(mode, timed))
        shutil.rmtree(root / "timed")
        small, large = root / "small" / "data", root / "large" / "data"
        small_bytes, small_shards = write_corpus(small, small_mb)
        stream_small = launch("stream", small)
        materialised = launch("materialised", small)
        shutil.rmtree(root / "small")
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
    print_table("streaming: memory against corpus size, time against the cache", rows, notes)


if __name__ == "__main__":
    main()
