"""Per-GB costs of the four checkpoint operations a 70B run pays, against the raw disk here.

Run (it starts its own 2 processes under torchrun):

    python bench/bench_scale.py                          # 512 MB and 2 GB models, 5 repeats
    python bench/bench_scale.py --sizes-mb 128 --repeats 3   # a quick look

docs/scaling.md extrapolates these to Llama-3.1-70B on 2 x 8 GPUs. On 2 ranks, each
repetition barrier to barrier, fsync on everywhere:

- step save: ``CheckpointClient.save(blocking=True)`` of a fully fine-tuned model (weights
  and both AdamW moments: 3 bytes of checkpoint per byte of weights), against each rank
  writing the same number of bytes with ``write`` and one ``fsync`` (the deletion of the
  checkpoint it supersedes runs in a background thread and is waited for untimed);
- resume load: ``CheckpointClient.load_latest()`` of that checkpoint, cold page cache
  (verification of every byte, DCP read into the sharded model and optimizer), against each
  rank reading its own files of the same checkpoint cold;

the four of them alternating, at least 5 times per model size, each pair in both orders in
turn (tunelab first in odd repeats), every timed write after a ``sync`` and every timed read
after dropping the files from the page cache. This virtual disk favours one of two
back-to-back writes by up to 2x (at 2 GB the second, at 512 MB the first; reads less), so a
pair always run in one order measures the order: each side's typical time is the geometric mean of its medians in the two
positions (an AB/BA crossover), printed with the ratio in each position, each rank's own
ratio (its time from the barrier to the end of its part) and the load average.
Targets (issue 31): step save and cold resume load within 1.2x of raw at 2 GB on 2 ranks.
At the first size only (they are unchanged by issue 31):

- consolidation: the full model's export, every rank writing its rows into the final
  ``model-0000k-of-0000n.safetensors`` files (``CheckpointClient.export``);
- adapter-first merged export: a LoRA model's export (PEFT adapter, then the shard-local
  merge written like the consolidation).

Each is divided by the bytes it writes or reads (s/GB), and by the time the raw disk takes for
the same bytes (each rank writing its half with one ``write`` and ``fsync``, or reading it
back cold): that ratio is what carries over to another machine's disk.
"""

import argparse
import math
import mmap
import os
import shutil
import time
from pathlib import Path

from _launch import relaunch_under_torchrun

if __name__ == "__main__":  # before the imports below: this process only relaunches
    relaunch_under_torchrun(2)

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import tunelab.peft as peft
from _common import (
    GiB,
    Row,
    barrier,
    gather_floats,
    is_main,
    median,
    print_table,
    seconds,
    time_collective,
)
from _models import (
    SMOKE_SIZE,
    build_model,
    init_optimizer_state,
    parse_size_args,
    prepare_workspace,
    size_parser,
)
from _system import drop_from_page_cache, files_under
from bench_resume import read_all
from tunelab.checkpoint import CheckpointClient, dcp
from tunelab.config.recipe_args import LoRAArgs
from tunelab.distributed import init_distributed

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    parser = size_parser(__doc__.splitlines()[0], repeats=5, full=False)
    parser.add_argument(
        "--sizes-mb", default="512,2048", help="fp32 model sizes, MB, comma-separated"
    )
    parser.add_argument(
        "--writes",
        choices=["direct", "buffered"],
        default="direct" if dcp.DIRECT_WRITES else "buffered",
        help="how step saves write their data files",
    )
    parser.add_argument(
        "--raw",
        choices=["buffered", "direct"],
        default="buffered",
        help="the raw baseline of the save and resume rows: buffered write + fsync and cold "
        "read (the default), or the same bytes with O_DIRECT",
    )
    parser.add_argument(
        "--reads",
        choices=["direct", "buffered"],
        default="direct" if dcp.DIRECT_READS else "buffered",
        help="how resumes read the data files",
    )
    return parse_size_args(parser, smoke=(*SMOKE_SIZE, "--sizes-mb", "8"))


def folder_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(file.stat().st_size for file in files_under(path))


_RAW_BLOCK = 256 << 20


def random_block(num_bytes: int) -> memoryview:
    """Random bytes to write from: ``num_bytes`` of them, at most ``_RAW_BLOCK`` (the write size).

    A file smaller than ``_RAW_BLOCK`` is one write of its bytes either way; drawing only those
    spares the smallest sizes (``--smoke``) 256 MB of random numbers per call.
    """
    size = max(1, min(num_bytes, _RAW_BLOCK))
    return memoryview(torch.randint(0, 256, (size,), dtype=torch.uint8).numpy())


def raw_write(path: Path, num_bytes: int, block: memoryview) -> None:
    """``num_bytes`` written once into a new file with one ``fsync`` (the disk's floor)."""
    with open(path, "wb", buffering=0) as handle:
        left = num_bytes
        while left:
            left -= handle.write(block[: min(left, len(block))])
        os.fsync(handle.fileno())


_DIRECT_BLOCK = 64 << 20  # the raw direct baseline's write and read size


def raw_write_direct(path: Path, num_bytes: int, block: memoryview) -> None:
    """``num_bytes`` (rounded up to 4 KB) written with ``O_DIRECT`` in 64 MB writes, one fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        offset, end = 0, num_bytes + (-num_bytes) % 4096
        while offset < end:
            offset += os.pwrite(fd, block[: min(end - offset, len(block))], offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_all_direct(files: list[Path], block: memoryview) -> int:
    """Every byte of ``files`` read with ``O_DIRECT`` into one aligned buffer; the byte count."""
    total = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            offset = 0
            while count := os.preadv(fd, [block], offset):
                offset += count
        finally:
            os.close(fd)
        total += offset
    return total


def timed(action) -> tuple[float, list[float]]:
    """``action`` barrier to barrier (the slowest rank), and each rank's own seconds."""
    barrier()
    start = time.perf_counter()
    action()
    mine = time.perf_counter() - start
    barrier()
    return time.perf_counter() - start, gather_floats(mine)


def rank_files(step_dir: Path, rank: int) -> list[Path]:
    """The data files rank ``rank`` wrote into a step checkpoint (what it reads on resume)."""
    return sorted(step_dir.glob(f"__{rank}_*.distcp"))


def step_rows(base: Path, out: Path, size_mb: float, repeats: int, raw_io: str) -> list[Row]:
    """Step save and cold resume load of a fully fine-tuned model, alternating with raw I/O.

    ``raw_io``: "buffered" (``write`` + ``fsync``, cold ``read``: the issue's baseline) or
    "direct" (the same bytes with ``O_DIRECT`` from an aligned 64 MB buffer: the device's
    pace without the page cache; informational, no target).
    """
    rank = dist.get_rank()
    model = build_model(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    init_optimizer_state(model, optimizer)
    client = CheckpointClient(
        out / "full", model=model, optimizer=optimizer, lr_scheduler=None,
        base_checkpoint_dir=base, keep_last_n=2,
    )  # fmt: skip
    steps = iter(range(1, 1000))
    step_dir = client.save(next(steps), 0, {}, blocking=True)  # warm-up
    client.load_latest()
    total_bytes = folder_bytes(step_dir)
    my_bytes = sum(path.stat().st_size for path in rank_files(step_dir, rank))
    block = random_block(max(my_bytes, _DIRECT_BLOCK if raw_io == "direct" else 0))
    scratch = out / "raw"
    if is_main():
        scratch.mkdir(parents=True, exist_ok=True)
    raw_file = scratch / f"raw-{rank}.bin"
    aligned = None
    if raw_io == "direct":
        aligned = memoryview(mmap.mmap(-1, _DIRECT_BLOCK))
        aligned[:] = block[:_DIRECT_BLOCK]

    def write_raw() -> None:
        if aligned is None:
            raw_write(raw_file, my_bytes, block)
        else:
            raw_write_direct(raw_file, my_bytes, aligned)

    def read_raw(files: list[Path]) -> int:
        return read_all(files) if aligned is None else read_all_direct(files, aligned)

    times: dict[str, list[tuple[float, list[float]]]] = {
        key: [] for key in ("raw write", "save", "raw read", "load")
    }
    for repeat in range(repeats):
        # Each pair runs in both orders, alternately: at 2 GB the first of two writes measured
        # up to 2x slower than the second, whichever it was (``settle`` before each timed
        # operation did not change that; it keeps earlier deletions out of the timed one).
        swap = repeat % 2 == 1
        raw_file.unlink(missing_ok=True)
        writes = [
            ("raw write", write_raw),
            ("save", lambda: client.save(next(steps), 0, {}, blocking=True)),
        ]
        for key, action in reversed(writes) if swap else writes:
            settle()
            times[key].append(timed(action))
            client.wait()  # untimed: the superseded checkpoint's deletion (a background thread)
        latest = client.run.step_dir(max(c.step for c in client.run.scan_checkpoints()[0]))
        everything = files_under(latest)
        mine = rank_files(latest, rank)
        reads = [("raw read", lambda mine=mine: read_raw(mine)), ("load", client.load_latest)]
        for key, action in reversed(reads) if swap else reads:
            settle()
            cold(everything + [raw_file])
            times[key].append(timed(action))
    raw_file.unlink(missing_ok=True)
    client.close()
    rows = []
    for name, ours, raw in (
        ("step save (weights + AdamW)", "save", "raw write"),
        ("resume load, cold cache", "load", "raw read"),
    ):
        # tunelab ran first in odd repeats, the raw disk in even ones (see above)
        t, t_second, t_first = crossover([total for total, _ in times[ours]])
        r, r_first, r_second = crossover([total for total, _ in times[raw]])
        per_rank = [
            crossover([ranks[i] for _, ranks in times[ours]])[0]
            / crossover([ranks[i] for _, ranks in times[raw]])[0]
            for i in range(dist.get_world_size())
        ]
        gb = total_bytes / 1e9
        at_2gb = size_mb >= 2048 and raw_io == "buffered"  # the target's baseline
        label = f"{name}, {size_mb:.0f} MB model" + (", raw O_DIRECT" if raw_io == "direct" else "")
        rows.append(Row(
            label, seconds(t), seconds(r), f"{t / r:.2f}x raw",
            "<= 1.2x" if at_2gb else "-", (t <= 1.2 * r) if at_2gb else None,
            (f"{total_bytes / GiB:.2f} GiB", ", ".join(f"{x:.2f}x" for x in per_rank),
             f"{t_first / r_first:.2f}x, {t_second / r_second:.2f}x",
             f"{t / gb:.2f} s/GB", f"{r / gb:.2f} s/GB",
             " ".join(f"{total:.2f}" for total, _ in times[ours]) + " vs "
             + " ".join(f"{total:.2f}" for total, _ in times[raw])),
        ))  # fmt: skip
    return rows


def crossover(runs: list[float]) -> tuple[float, float, float]:
    """Runs alternating between two positions: (their typical time, even runs, odd runs).

    The typical time is the geometric mean of the two positions' medians: each position
    weighs the same however much the disk favours one (an AB/BA crossover), where the median
    of all runs would fall between the two positions' clusters.
    """
    even, odd = median(runs[0::2]), median(runs[1::2] or runs[0::2])
    return math.sqrt(even * odd), even, odd


def settle() -> None:
    """Let the file system finish what earlier deletions left (rank 0 ``sync``), then barrier.

    The disk here is mounted with online discard: the blocks of deleted files are discarded
    at the next journal commit, which the next timed writer's ``fsync`` would otherwise
    include. A trainer's saves are minutes apart, so the commit happens between them.
    """
    if is_main():
        os.sync()
    barrier()


def cold(files: list[Path]) -> None:
    """Drop ``files`` from the page cache (rank 0), then barrier."""
    if is_main():
        drop_from_page_cache(files)
    barrier()


def clear(path: Path) -> None:
    """Remove ``path`` on rank 0, then barrier."""
    if is_main():
        shutil.rmtree(path, ignore_errors=True)
    barrier()


def measure(name, action, num_bytes, raw, repeats, before=None) -> Row:
    """A row: median seconds of ``action``, s/GB and the ratio to the raw disk."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        times.append(time_collective(action))
    t, r = median(times), median(raw)
    gb = num_bytes / 1e9
    return Row(name, seconds(t), seconds(r), f"{t / r:.2f}x raw", "-", None,
               (f"{num_bytes / GiB:.2f} GiB", "-", "-", f"{t / gb:.2f} s/GB", f"{r / gb:.2f} s/GB",
                " ".join(f"{x:.2f}" for x in times) + " vs " + " ".join(f"{x:.2f}" for x in raw)))  # fmt: skip


def measure_export(name: str, client: CheckpointClient, out: Path, repeats: int) -> Row:
    """The row of ``client.export(0)``, each time into an empty folder, against raw writes."""
    export_dir = client.output_dir / "epoch_0"
    client.export(0)  # warm-up
    num_bytes = folder_bytes(export_dir)
    raw = raw_times(out, num_bytes, repeats)
    return measure(
        name, lambda: client.export(0), num_bytes, raw, repeats, before=lambda: clear(export_dir)
    )


def main() -> None:
    """Measure the operations and their raw-disk floors; print the table on rank 0."""
    args = parse_args()
    init_distributed("cpu")
    dcp.DIRECT_WRITES = args.writes == "direct"
    dcp.DIRECT_READS = args.reads == "direct"
    sizes = [float(size) for size in args.sizes_mb.split(",")]
    load_before = os.getloadavg()[0]
    rows, notes = [], []
    for number, size_mb in enumerate(sizes):
        args.size_mb = size_mb
        workspace = prepare_workspace(args, "tunelab_bench_scale")
        base, out = workspace.base, workspace.out
        rows += step_rows(base, out, size_mb, args.repeats, args.raw)
        notes.append(f"{size_mb:.0f} MB: {workspace.weight_bytes / GiB:.2f} GiB of fp32 weights")
        if number == 0:
            rows += export_rows(base, out, args.repeats)
        if is_main():
            shutil.rmtree(workspace.root, ignore_errors=True)
        barrier()

    if is_main():
        print_table(
            "Scale: per-GB cost of save, resume, consolidation and merged export vs raw disk",
            rows,
            [
                "; ".join(notes) + f"; {dist.get_world_size()} ranks, fsync on, "
                f"{args.writes} step saves, {args.reads} resume reads, {args.raw} raw I/O, "
                f"{args.repeats} runs; load average {load_before:.1f} before, "
                f"{os.getloadavg()[0]:.1f} after. The raw column writes (one fsync) or reads "
                "(cold) the same bytes, each rank its own share. Save and resume: each pair "
                "in both orders in turn (tunelab first in odd runs), each side's time the "
                "geometric mean of its medians in the two positions; 1st, 2nd: the ratio "
                "when each ran first and when each ran second; exports: medians. Per rank: "
                "each rank's own time over its raw time. s/GB divides by the bytes written "
                "or read (GB = 1e9 bytes). The last column: every run, tunelab vs raw, in "
                "seconds."
            ],
            extra_columns=["bytes", "per rank", "1st, 2nd", "tunelab s/GB", "raw s/GB", "runs (s)"],
        )
    dist.barrier()
    dist.destroy_process_group()


def export_rows(base: Path, out: Path, repeats: int) -> list[Row]:
    """Consolidation and the adapter-first merged export, against raw writes."""
    rows = []
    model = build_model(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    client = CheckpointClient(
        out / "export", model=model, optimizer=optimizer, lr_scheduler=None,
        base_checkpoint_dir=base,
    )  # fmt: skip
    rows.append(measure_export("consolidation (full model export)", client, out, repeats))
    client.close()
    del model, optimizer, client

    # LoRA: the adapter first, then the merged model.
    lora_args = LoRAArgs(rank=16, alpha=32.0, targets=TARGETS)
    model = build_model(base, lora=lora_args)
    with torch.no_grad():  # a trained adapter: B != 0, so the merge changes every weight
        for param in peft.get_adapter_params(model).values():
            (param.to_local() if isinstance(param, DTensor) else param).normal_(0.0, 0.01)
    optimizer = torch.optim.AdamW(peft.get_adapter_params(model).values(), lr=1e-4)
    client = CheckpointClient(
        out / "lora", model=model, optimizer=optimizer, lr_scheduler=None,
        base_checkpoint_dir=base, lora=lora_args,
    )  # fmt: skip
    rows.append(measure_export("adapter-first merged export (LoRA)", client, out, repeats))
    client.close()
    return rows


def raw_times(out: Path, num_bytes: int, repeats: int) -> list[float]:
    """Raw disk seconds for ``num_bytes`` written and fsynced, each rank its share."""
    scratch = out / "raw"
    if is_main():
        scratch.mkdir(parents=True, exist_ok=True)
    barrier()
    path = scratch / f"raw-{dist.get_rank()}.bin"
    block = random_block(num_bytes // dist.get_world_size())
    times = []
    for _ in range(repeats):
        path.unlink(missing_ok=True)
        times.append(
            time_collective(lambda: raw_write(path, num_bytes // dist.get_world_size(), block))
        )
    clear(scratch)
    return times


if __name__ == "__main__":
    main()
