"""Per-GB costs of the four checkpoint operations a 70B run pays, against the raw disk here.

Run (it starts its own 2 processes under torchrun):

    python bench/bench_scale.py                 # ~128 MB of fp32 base weights, 3 repeats
    python bench/bench_scale.py --size-mb 512

docs/scaling.md extrapolates these to Llama-3.1-70B on 2 x 8 GPUs. On 2 ranks, each
repetition barrier to barrier, fsync on everywhere:

- intermediate save: ``CheckpointClient.save(blocking=True)`` of a fully fine-tuned model
  (weights and both AdamW moments: 3 bytes of checkpoint per byte of weights);
- resume load: ``CheckpointClient.load_latest()`` of that checkpoint, cold page cache
  (verification of every file, DCP read into the sharded model and optimizer);
- consolidation: the full model's export, every rank writing its rows into the final
  ``model-0000k-of-0000n.safetensors`` files (``CheckpointClient.export``);
- adapter-first merged export: a LoRA model's export (PEFT adapter, then the shard-local
  merge written like the consolidation).

Each is divided by the bytes it writes or reads (s/GB), and by the time the raw disk takes for
the same bytes (each rank writing its half with one ``write`` and ``fsync``, or reading it
back cold): that ratio is what carries over to another machine's disk.
"""

import argparse
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import tunelab.peft as peft
from _common import (
    GiB,
    Row,
    barrier,
    is_main,
    median,
    print_table,
    relaunch_under_torchrun,
    seconds,
    time_collective,
)
from _models import (
    build_model,
    init_optimizer_state,
    parse_size_args,
    prepare_workspace,
    size_parser,
)
from _system import drop_from_page_cache, files_under
from bench_resume import my_files, read_all
from tunelab.checkpoint import CheckpointClient, LoRASpec
from tunelab.config.recipe_args import LoRAArgs
from tunelab.distributed import init_distributed

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    parser = size_parser(__doc__.splitlines()[0], repeats=3, full=False)
    parser.set_defaults(size_mb=128)
    return parse_size_args(parser)


def folder_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(file.stat().st_size for file in files_under(path))


def raw_write(path: Path, data: memoryview) -> None:
    """This rank's share of the bytes, written once and fsynced (the disk's floor)."""
    with open(path / f"raw-{dist.get_rank()}.bin", "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


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
               (f"{num_bytes / GiB:.2f} GiB", f"{t / gb:.2f} s/GB", f"{r / gb:.2f} s/GB"))  # fmt: skip


def measure_export(name: str, client: CheckpointClient, out: Path, repeats: int) -> Row:
    """The row of ``client.export(0)``, each time into an empty folder, against raw writes."""
    export_dir = client.output_dir / "epoch_0"
    client.export(0)  # warm-up
    num_bytes = folder_bytes(export_dir)
    raw = raw_times(out, num_bytes, repeats, write=True)
    return measure(
        name, lambda: client.export(0), num_bytes, raw, repeats, before=lambda: clear(export_dir)
    )


def main() -> None:
    """Measure the four operations and their raw-disk floors; print the table on rank 0."""
    args = parse_args()
    init_distributed("cpu")
    workspace = prepare_workspace(args, "tunelab_bench_scale")
    base, out = workspace.base, workspace.out
    rows = []

    # Full fine-tuning: step save, resume load, consolidated export.
    model = build_model(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    init_optimizer_state(model, optimizer)
    client = CheckpointClient(
        out / "full",
        model=model,
        optimizer=optimizer,
        lr_scheduler=None,
        base_checkpoint_dir=base,
        keep_last_n=2,
    )
    steps = iter(range(1, 1000))
    step_dir = client.save(next(steps), 0, {}, blocking=True)  # warm-up
    save_bytes = folder_bytes(step_dir)
    rows.append(measure(
        "intermediate save (weights + AdamW)",
        lambda: client.save(next(steps), 0, {}, blocking=True),
        save_bytes, raw_times(out, save_bytes, args.repeats, write=True), args.repeats,
    ))  # fmt: skip
    latest = files_under(client.output_dir / f"step_{args.repeats + 1}")
    rows.append(measure(
        "resume load, cold cache", client.load_latest, save_bytes,
        raw_times(out, save_bytes, args.repeats, write=False, files=latest), args.repeats,
        before=lambda: cold(latest),
    ))  # fmt: skip
    rows.append(measure_export("consolidation (full model export)", client, out, args.repeats))
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
        base_checkpoint_dir=base, lora=LoRASpec(rank=16, alpha=32.0, targets=tuple(TARGETS)),
    )  # fmt: skip
    rows.append(measure_export("adapter-first merged export (LoRA)", client, out, args.repeats))
    client.close()

    if is_main():
        shutil.rmtree(workspace.root, ignore_errors=True)
        print_table(
            "Scale: per-GB cost of save, resume, consolidation and merged export vs raw disk",
            rows,
            [
                f"{workspace.weight_bytes / GiB:.2f} GiB of fp32 base weights, "
                f"{dist.get_world_size()} ranks, fsync on, median of {args.repeats}; the raw "
                "column writes (fsync) or reads (cold) the same bytes, each rank its half. "
                "s/GB divides by the bytes written or read (GB = 1e9 bytes)."
            ],
            extra_columns=["bytes", "tunelab s/GB", "raw s/GB"],
        )
    dist.barrier()
    dist.destroy_process_group()


def raw_times(out: Path, num_bytes: int, repeats: int, *, write: bool, files=None) -> list[float]:
    """Raw disk seconds for ``num_bytes``: written and fsynced, or ``files`` read back cold."""
    scratch = out / "raw"
    if is_main():
        scratch.mkdir(parents=True, exist_ok=True)
    barrier()
    mine = [] if write else my_files(files, dist.get_rank(), dist.get_world_size())
    # Random bytes, made before the clock starts (each rank writes its half).
    share = torch.randint(0, 256, (num_bytes // dist.get_world_size() if write else 0,))
    data = memoryview(share.to(torch.uint8).numpy())
    times = []
    for _ in range(repeats):
        if write:
            times.append(time_collective(lambda: raw_write(scratch, data)))
        else:
            cold(files)
            times.append(time_collective(lambda: read_all(mine)))
    clear(scratch)
    return times


if __name__ == "__main__":
    relaunch_under_torchrun(2)
    main()
