"""Time HF safetensors exports of FSDP2-sharded state: tunelab's writer vs torch's vs raw disk.

Run (it relaunches itself under torchrun with 2 processes, gloo, CPU):

    python bench/bench_hf_write.py --size-mb 256

Every figure is the median of ``--repeats`` runs of the same sharded state (fp32 ``Shard(0)``
matrices, some with uneven rows, plus a small replicated vector), two output files mapped
like a base model's index, barrier to barrier on every rank:
(a) ``HFSafetensorsWriter`` through ``dcp.save``;
(b) torch's ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``;
(c) raw sequential writes of the same bytes, each rank its own share into its own file.
All three use the same fsync setting (``--sync-files``; off by default so the figures measure
the software path rather than this machine's disk flush).
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _launch import relaunch_under_torchrun

if __name__ == "__main__":  # before the imports below: this process only relaunches
    relaunch_under_torchrun(2)

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from _common import Row, parse_bench_args, print_table, seconds
from tunelab.checkpoint.consolidate import HFSafetensorsWriter

COLUMNS = 1024


def build_state(size_mb: int, mesh) -> dict[str, torch.Tensor]:
    """Sharded fp32 matrices of about ``size_mb`` MB in all, built from local rows only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    num_tensors = 16
    rows = max(world, size_mb * 10**6 // (4 * COLUMNS * num_tensors))
    generator = torch.Generator().manual_seed(rank)
    state: dict[str, torch.Tensor] = {}
    for i in range(num_tensors):
        num_rows = rows + (i % 3)  # some uneven splits, as FSDP2 gives them
        per_rank = -(-num_rows // world)  # torch.chunk: ceil, later ranks fewer rows
        start = min(num_rows, rank * per_rank)
        local = torch.randn(min(per_rank, num_rows - start), COLUMNS, generator=generator)
        state[f"model.layers.{i}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], shape=torch.Size([num_rows, COLUMNS]), stride=(COLUMNS, 1)
        )
    state["model.norm.weight"] = torch.ones(COLUMNS)  # replicated: written by one rank
    return state


def time_once(action, cleanup) -> float:
    dist.barrier()
    start = time.perf_counter()
    action()
    dist.barrier()
    elapsed = time.perf_counter() - start
    cleanup()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256, help="total tensor bytes, MB")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sync-files", action="store_true", help="fsync in all three")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    args = parse_bench_args(parser, smoke=["--size-mb", "8", "--repeats", "1"])

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = build_state(args.size_mb, mesh)
    names = list(state)
    fqn_to_index = {key: 1 if i < len(names) // 2 else 2 for i, key in enumerate(names)}
    fqn_to_file = {key: f"model-0000{i}-of-00002.safetensors" for key, i in fqn_to_index.items()}
    total_bytes = sum(t.numel() * t.element_size() for t in state.values())

    root = Path(args.dir or tempfile.gettempdir()) / "tunelab_bench_hf_write"
    out = root / "out"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()

    def cleanup() -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()  # torch's consolidation does not create its output folder
        dist.barrier()

    def tunelab_write() -> None:
        writer = HFSafetensorsWriter(out, fqn_to_file=fqn_to_file, sync_files=args.sync_files)
        dcp.save(state, storage_writer=writer)

    def torch_write() -> None:
        writer = dcp.HuggingFaceStorageWriter(
            str(out),
            fqn_to_index_mapping=fqn_to_index,
            save_distributed=True,
            enable_consolidation=True,
        )
        writer.sync_files = args.sync_files  # FileSystemWriter's flag; same setting for all
        dcp.save(state, storage_writer=writer)

    def raw_write() -> None:
        # Each rank's share, once, sequentially: what DCP's dedup assigns is about even.
        with open(out / f"raw-{rank}.bin", "wb") as handle:
            for tensor in state.values():
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if isinstance(tensor, DTensor) or rank == 0:
                    handle.write(memoryview(local.reshape(-1).view(torch.uint8).numpy()))
            handle.flush()
            if args.sync_files:
                os.fsync(handle.fileno())

    # Interleaved rounds, so a burst of load from other processes hits all three alike.
    times: dict[str, list[float]] = {"tunelab": [], "torch": [], "raw": []}
    actions = {"tunelab": tunelab_write, "torch": torch_write, "raw": raw_write}
    # One untimed warm-up of every compared path (imports, page cache, first-call costs), so
    # none of them pays its first call in the timed rounds.
    cleanup()
    for action in actions.values():
        action()
        cleanup()
    for _ in range(args.repeats):
        for name, action in actions.items():
            times[name].append(time_once(action, cleanup))
    t_tunelab, t_torch, t_raw = (statistics.median(times[name]) for name in actions)

    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        gib = total_bytes / 2**30
        rows = [
            Row("vs torch HF writer (consolidating)", seconds(t_tunelab), seconds(t_torch),
                f"{t_torch / t_tunelab:.2f}x", ">= 2x faster", t_torch / t_tunelab >= 2.0),
            Row("vs raw sequential write", seconds(t_tunelab), seconds(t_raw),
                f"{t_tunelab / t_raw:.2f}x", "<= 1.3x raw time", t_tunelab / t_raw <= 1.3),
        ]  # fmt: skip
        print_table(
            "HF safetensors export of sharded state: tunelab's writer vs torch's vs raw disk",
            rows,
            notes=[
                f"{gib:.2f} GiB fp32, {dist.get_world_size()} ranks, {len(state)} tensors, "
                f"2 files, sync_files={args.sync_files}, median of {args.repeats} after one "
                "untimed warm-up of each path",
                f"tunelab: {gib / t_tunelab:.2f} GiB/s; raw: {gib / t_raw:.2f} GiB/s",
            ],
        )
    dist.barrier()  # rank 0 prints first; tear down only once all ranks are done
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
