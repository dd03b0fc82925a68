"""Time the trainer is blocked by an async intermediate save vs a synchronous save.

Run (it starts its own 2 processes under torchrun):

    python bench/bench_async_save.py            # ~256 MB of fp32 weights
    python bench/bench_async_save.py --full     # >= 1 GB of fp32 weights

A Llama-style model of random weights (a synthetic Hugging Face folder) is built with the
recipes' ``build_model``, sharded with FSDP2 on 2 ranks, fully fine-tuned (every weight
trains), so a step checkpoint holds the weights and AdamW's two moments: 3x the weight
bytes. Each repetition, barrier to return on every rank, the slowest rank counts:

- ``CheckpointClient(enable_async=True).save(...)``: returns once the state is staged to CPU
  (what the trainer waits for); the write goes on in the background and is waited for,
  untimed, before the next repetition;
- ``CheckpointClient(enable_async=False).save(...)``: the whole DCP save, fsync and commit.

Both clients use the library's default writer (fsync on). Target: blocked <= 5% of sync.
"""

import argparse
import shutil

from _launch import relaunch_under_torchrun

if __name__ == "__main__":  # before the imports below: this process only relaunches
    relaunch_under_torchrun(2)

import torch
import torch.distributed as dist

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


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    return parse_size_args(size_parser(__doc__.splitlines()[0]))


def local_state(model, optimizer) -> list[torch.Tensor]:
    """This rank's tensors of the saved state: parameter shards and their AdamW moments."""
    tensors = []
    for param in model.parameters():
        tensors.append(param.to_local() if hasattr(param, "to_local") else param)
        for value in optimizer.state[param].values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors.append(value.to_local() if hasattr(value, "to_local") else value)
    return tensors


def copy_floor(tensors: list[torch.Tensor], repeats: int) -> float:
    """Median seconds (slowest rank) to copy ``tensors`` into preallocated CPU buffers.

    This is the least an async save must block for: the state has to be copied before the
    next optimizer step changes it (the stager keeps its buffers between saves, like these).
    """
    buffers = [torch.empty_like(tensor) for tensor in tensors]
    times = []
    for _ in range(repeats + 1):

        def copy() -> None:
            for buffer, tensor in zip(buffers, tensors, strict=True):
                buffer.copy_(tensor)

        times.append(time_collective(copy))
    return median(times[1:])


def main() -> None:
    """Build the model, time both saves, print the table on rank 0."""
    args = parse_args()
    from tunelab.checkpoint import CheckpointClient
    from tunelab.distributed import init_distributed

    init_distributed("cpu")
    workspace = prepare_workspace(args, "tunelab_bench_async_save")
    root, base, out = workspace.root, workspace.base, workspace.out

    model = build_model(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    init_optimizer_state(model, optimizer)
    clients = {
        mode: CheckpointClient(
            out / mode,
            model=model,
            optimizer=optimizer,
            lr_scheduler=None,
            base_checkpoint_dir=base,
            enable_async=mode == "async",
        )
        for mode in ("async", "sync")
    }
    step = 0

    def save(mode: str) -> float:
        nonlocal step
        step += 1
        elapsed = time_collective(lambda: clients[mode].save(step, 0, {"bench": True}))
        if mode == "async":
            clients[mode].wait()  # untimed: the background write of this repetition
        barrier()
        if is_main():
            shutil.rmtree(out / mode / f"step_{step}", ignore_errors=True)
        return elapsed

    # Warm-up: the stager allocates its CPU buffers on the first async save.
    save("async")
    save("sync")
    times: dict[str, list[float]] = {"async": [], "sync": []}
    for _ in range(args.repeats):
        for mode in times:  # interleaved, so load from other processes hits both alike
            times[mode].append(save(mode))
    blocked, sync = median(times["async"]), median(times["sync"])
    floor = copy_floor(local_state(model, optimizer), args.repeats)
    for client in clients.values():
        client.close()
    state_bytes = gather_floats(
        sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in model.parameters())
    )
    if is_main():
        shutil.rmtree(root, ignore_errors=True)
        saved_gib = 3 * sum(state_bytes) / GiB  # weights + AdamW's exp_avg and exp_avg_sq
        print_table(
            "Async intermediate save: time the trainer is blocked",
            [
                Row(
                    "blocked by async save vs sync save",
                    seconds(blocked),
                    seconds(sync),
                    f"{100 * blocked / sync:.1f}%",
                    "<= 5% of sync",
                    blocked <= 0.05 * sync,
                )
            ],
            [
                f"{workspace.weight_bytes / 1e9:.2f} GB fp32 weights, {saved_gib:.2f} GiB saved state "
                f"(weights + AdamW moments), {dist.get_world_size()} ranks, fsync on, "
                f"median of {args.repeats}; plain copy of each rank's state into preallocated "
                f"buffers (the staging floor): {floor:.3f} s; all async times: "
                + ", ".join(f"{t:.3f}" for t in times["async"])
                + " s; sync: "
                + ", ".join(f"{t:.3f}" for t in times["sync"])
                + " s"
            ],
        )
    dist.barrier()  # rank 0 prints first; tear down only once all ranks are done
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
