"""Time to restore from the newest step checkpoint vs the raw read time of its bytes.

Run (it starts its own 2 processes under torchrun):

    python bench/bench_resume.py               # ~256 MB of fp32 weights
    python bench/bench_resume.py --full        # >= 1 GB of fp32 weights

A fully fine-tuned Llama-style model (weights and both AdamW moments in the checkpoint) is
built with the recipes' ``build_model`` on 2 ranks and saved once with ``CheckpointClient``.
Each repetition, barrier to barrier:

- tunelab: ``CheckpointClient.load_latest()``: finding and verifying the newest committed
  step, reading it with DCP into the sharded model and optimizer, restoring the trainer state;
- raw: every byte of the step folder read once with ``readinto``, the files split between
  the ranks by size, in parallel.

Cold rows drop the folder's files from the page cache first (``posix_fadvise(DONTNEED)``: no
privileges needed, but on a virtual machine the host may still cache them); warm rows read
again right after. No target is set by the issue: the ratio shows the restore overhead.
"""

import argparse
import shutil
from pathlib import Path

from _launch import relaunch_under_torchrun

if __name__ == "__main__":  # before the imports below: this process only relaunches
    relaunch_under_torchrun(2)

import torch
import torch.distributed as dist

from _common import (
    GiB,
    Row,
    barrier,
    is_main,
    median,
    print_table,
    seconds,
    time_collective,
)
from _models import (
    build_model,
    parse_size_args,
    prepare_workspace,
    size_parser,
)
from _system import drop_from_page_cache, files_under
from tunelab.checkpoint import CheckpointClient
from tunelab.distributed import init_distributed

_CHUNK = 64 * 2**20


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    return parse_size_args(size_parser(__doc__.splitlines()[0]))


def my_files(files: list[Path], rank: int, world_size: int) -> list[Path]:
    """This rank's share of ``files``: largest first, each to the least loaded rank."""
    loads = [0] * world_size
    mine = []
    for path in sorted(files, key=lambda p: p.stat().st_size, reverse=True):
        owner = loads.index(min(loads))
        loads[owner] += path.stat().st_size
        if owner == rank:
            mine.append(path)
    return mine


def read_all(files: list[Path]) -> int:
    """Read every byte of ``files`` into one reused buffer; return the byte count."""
    buffer = memoryview(bytearray(_CHUNK))
    total = 0
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while count := handle.readinto(buffer):
                total += count
    return total


def main() -> None:
    """Save one step checkpoint, time restores and raw reads, print the table on rank 0."""
    args = parse_args()
    init_distributed("cpu")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    workspace = prepare_workspace(args, "tunelab_bench_resume")
    root, base, out = workspace.root, workspace.base, workspace.out
    model = build_model(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for param in model.parameters():  # AdamW's moments exist, so they are saved and restored
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    client = CheckpointClient(
        out, model=model, optimizer=optimizer, lr_scheduler=None, base_checkpoint_dir=base
    )
    step_dir = client.save(1, 0, {"bench": True})
    barrier()
    files = files_under(step_dir)
    mine = my_files(files, rank, world_size)
    total_bytes = sum(path.stat().st_size for path in files)

    def drop() -> None:
        if is_main():
            drop_from_page_cache(files)
        barrier()

    def restore() -> None:
        resumed = client.load_latest()
        assert resumed is not None and resumed.step == 1, resumed

    times: dict[str, list[float]] = {key: [] for key in ("cold", "cold_raw", "warm", "warm_raw")}
    restore()  # warm-up: imports and first-call costs
    for _ in range(args.repeats):
        drop()
        times["cold"].append(time_collective(restore))
        drop()
        times["cold_raw"].append(time_collective(lambda: read_all(mine)))
        times["warm"].append(time_collective(restore))
        times["warm_raw"].append(time_collective(lambda: read_all(mine)))
    client.close()
    if is_main():
        shutil.rmtree(root, ignore_errors=True)
        t = {key: median(values) for key, values in times.items()}
        print_table(
            "Resume: restore the newest step checkpoint vs raw read of its bytes",
            [
                Row(
                    "restore vs raw read, cold page cache",
                    seconds(t["cold"]),
                    seconds(t["cold_raw"]),
                    f"{t['cold'] / t['cold_raw']:.2f}x raw",
                    "-",
                    None,
                ),
                Row(
                    "restore vs raw read, warm page cache",
                    seconds(t["warm"]),
                    seconds(t["warm_raw"]),
                    f"{t['warm'] / t['warm_raw']:.2f}x raw",
                    "-",
                    None,
                ),
            ],  # fmt: skip
            [
                f"{total_bytes / GiB:.2f} GiB in {len(files)} files (weights + AdamW moments), "
                f"{world_size} ranks, median of {args.repeats}; "
                f"raw read {total_bytes / GiB / t['cold_raw']:.2f} GiB/s cold, "
                f"{total_bytes / GiB / t['warm_raw']:.2f} GiB/s warm"
            ],
        )
    dist.barrier()  # rank 0 prints first; tear down only once all ranks are done
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
