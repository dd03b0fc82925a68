"""What checksums cost: step saves and exports with the per-file XXH3-128 digests vs without.

Run (it starts its own 2 processes under torchrun):

    python bench/bench_checksum.py            # ~256 MB of fp32 weights
    python bench/bench_checksum.py --full     # >= 1 GB of fp32 weights

A Llama-style model of random weights is built with the recipes' ``build_model``, sharded
with FSDP2 on 2 ranks and fully fine-tuned (so a step checkpoint holds the weights and AdamW's
two moments). Interleaved repetitions, the slowest rank counts, fsync on in both:

- step save: ``dcp.save`` of the same state through tunelab's ``ChecksummedWriter`` (every
  2 MB piece hashed as it is written) vs the same writer with the digest replaced by a
  no-op, as runs make it (``O_DIRECT``, fsync on) and at memory speed (buffered writes,
  fsync off: the digest's share at its largest). Target (issue 31): at most 2% slower. torch's own ``FileSystemWriter`` (a ``torch.save`` record per tensor,
  pickled metadata, no checksums) is timed beside them, for information.
- export: the same ``CheckpointClient.export`` with its per-piece digests vs with the digest
  replaced by a no-op (pieces are hashed in a second thread while they are written). Target:
  at most 5% slower.
"""

import argparse
import os
import shutil

from _launch import relaunch_under_torchrun

if __name__ == "__main__":  # before the imports below: this process only relaunches
    relaunch_under_torchrun(2)

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

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
    build_model,
    init_optimizer_state,
    parse_size_args,
    prepare_workspace,
    size_parser,
)


class _NoDigest:
    """Stands in for the ``xxhash`` module: a digest that hashes nothing."""

    class xxh3_128:  # noqa: N801 - the name it replaces
        def __init__(self, data: object = b"") -> None:
            pass

        def update(self, data: object) -> None:
            pass

        def hexdigest(self) -> str:
            return "0" * 32


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    return parse_size_args(size_parser(__doc__.splitlines()[0]))


def main() -> None:
    """Build the model, time both kinds of save and the export's hashing; print on rank 0."""
    args = parse_args()
    from tunelab.checkpoint import CheckpointClient
    from tunelab.checkpoint.dcp import ChecksummedWriter
    from tunelab.distributed import init_distributed

    init_distributed("cpu")
    workspace = prepare_workspace(args, "tunelab_bench_checksum")
    root, base, out = workspace.root, workspace.base, workspace.out
    model = build_model(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    init_optimizer_state(model, optimizer)  # AdamW's moments exist, as in a real checkpoint
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions())
    optim_sd.pop("param_groups")
    state = {"model": model_sd, "optimizer": optim_sd}
    writers = {
        # fsync off and buffered writes on every side: a save at memory speed, where the
        # digest (CPU work) has its largest share: the stricter comparison. (O_DIRECT writes
        # reach the disk whatever fsync says.)
        "checksummed": lambda path: ChecksummedWriter(path, sync_files=False, direct=False),
        "plain": lambda path: ChecksummedWriter(path, sync_files=False, direct=False),
        "torch": lambda path: dcp.FileSystemWriter(path, sync_files=False),
        # The save as runs make it: fsync on, O_DIRECT, the disk's time in both.
        "checksummed_fsync": lambda path: ChecksummedWriter(path, sync_files=True),
        "plain_fsync": lambda path: ChecksummedWriter(path, sync_files=True),
    }
    count = 0
    import tunelab.checkpoint._tensor_files as tensor_files

    real_xxhash = tensor_files.xxhash

    def save(kind: str) -> float:
        nonlocal count
        count += 1
        path = out / f"{kind}_{count}"
        # "plain": the same writer with the digest replaced by a no-op.
        tensor_files.xxhash = real_xxhash if not kind.startswith("plain") else _NoDigest
        try:
            elapsed = time_collective(lambda: dcp.save(state, storage_writer=writers[kind](path)))
        finally:
            tensor_files.xxhash = real_xxhash
        barrier()
        if is_main():
            shutil.rmtree(path, ignore_errors=True)
        return elapsed

    for kind in writers:  # warm-up
        save(kind)
    times: dict[str, list[float]] = {kind: [] for kind in writers}
    for repeat in range(args.repeats):  # alternating: load changes hit every kind alike,
        # and in reverse order every other repeat: the disk here favours the second of two
        # back-to-back writes (bench_scale.py), which a fixed order would credit to one kind.
        for kind in list(times)[:: -1 if repeat % 2 else 1]:
            times[kind].append(save(kind))
    checksummed, plain = median(times["checksummed"]), median(times["plain"])
    torch_writer = median(times["torch"])
    synced, plain_synced = median(times["checksummed_fsync"]), median(times["plain_fsync"])

    client = CheckpointClient(
        out / "export",
        model=model,
        optimizer=optimizer,
        lr_scheduler=None,
        base_checkpoint_dir=base,
    )
    import tunelab.checkpoint._safetensors_layout as safetensors_layout

    real_digest = safetensors_layout.digest

    def export(kind: str) -> float:
        # "plain": the same export with the per-piece digest replaced by a no-op.
        safetensors_layout.digest = real_digest if kind == "checksummed" else (lambda data: "")
        try:
            return time_collective(lambda: client.export(0))
        finally:
            safetensors_layout.digest = real_digest

    export("checksummed")  # warm-up
    export("plain")
    export_times: dict[str, list[float]] = {kind: [] for kind in writers}
    for _ in range(args.repeats):
        for kind in export_times:
            export_times[kind].append(export(kind))
    export_checksummed = median(export_times["checksummed"])
    export_plain = median(export_times["plain"])
    client.close()
    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    state_bytes = sum(gather_floats(sum(t.numel() * t.element_size() for t in local)))
    if is_main():
        shutil.rmtree(root, ignore_errors=True)
        print_table(
            "Checksums: cost of hashing every file as it is written",
            [
                Row(
                    "step save (O_DIRECT, fsync on), checksummed vs the same writer without digests",
                    seconds(synced),
                    seconds(plain_synced),
                    f"{synced / plain_synced:.3f}x",
                    "<= 1.02x",
                    synced <= 1.02 * plain_synced,
                ),
                Row(
                    "step save (buffered, fsync off), checksummed vs the same writer without digests",
                    seconds(checksummed),
                    seconds(plain),
                    f"{checksummed / plain:.3f}x",
                    "<= 1.02x",
                    checksummed <= 1.02 * plain,
                ),
                Row(
                    "step save (buffered, fsync off), checksummed vs torch's FileSystemWriter",
                    seconds(checksummed),
                    seconds(torch_writer),
                    f"{checksummed / torch_writer:.3f}x",
                    "-",
                    None,
                ),
                Row(
                    "export, checksummed vs without digests",
                    seconds(export_checksummed),
                    seconds(export_plain),
                    f"{export_checksummed / export_plain:.3f}x",
                    "<= 1.05x",
                    export_checksummed <= 1.05 * export_plain,
                ),
            ],
            [
                f"{workspace.weight_bytes / 1e9:.2f} GB fp32 weights; a step save writes "
                f"{3 * state_bytes / GiB:.2f} GiB (weights + AdamW moments); "
                f"{dist.get_world_size()} ranks, median of {args.repeats} alternating runs; "
                f"load average {os.getloadavg()[0]:.1f}; exports with fsync on. "
                "Checksummed saves: "
                + ", ".join(f"{t:.3f}" for t in times["checksummed"])
                + " s; without digests: "
                + ", ".join(f"{t:.3f}" for t in times["plain"])
                + " s; with fsync, checksummed: "
                + ", ".join(f"{t:.3f}" for t in times["checksummed_fsync"])
                + " s; without digests: "
                + ", ".join(f"{t:.3f}" for t in times["plain_fsync"])
                + " s; torch's writer: "
                + ", ".join(f"{t:.3f}" for t in times["torch"])
                + " s; exports checksummed: "
                + ", ".join(f"{t:.3f}" for t in export_times["checksummed"])
                + " s; without: "
                + ", ".join(f"{t:.3f}" for t in export_times["plain"])
                + " s. Each export piece is hashed in a second thread while it is written. XXH3-128 runs at ~26 GB/s on one core here (SHA-256 1.7, BLAKE2b 0.9)."
            ],
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
