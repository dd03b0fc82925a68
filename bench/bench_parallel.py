"""Tensor parallelism: per-process memory of one long row, TP 2 vs FSDP 2 (the "parallel" rows).

Run (2 processes under torchrun; the script relaunches itself):

    python bench/bench_parallel.py                  # one row of 4096 tokens
    python bench/bench_parallel.py --smoke          # a smoke size

A Llama-shaped decoder (dim 512, head_dim 64, 8 query and 2 K/V heads, feed-forward 3.5 x dim,
4 layers, vocabulary 8192; fp32 on CPU) trains one row per data-parallel group with the chunked
cross-entropy, through the recipes' own ``batch_loss``. Both layouts live side by side on the
same 2 processes (one thread each), built from the same seed:

- FSDP 2: parameters sharded over both processes (``shard_model``); each process trains its
  own row (a process cannot hold less than one row);
- TP 2: the two processes split every matmul of one row between them
  (``parallelize_decoder``: column/row-wise projections, sequence-parallel norms, the
  vocabulary-split output and loss), FSDP2 over the data-parallel dimension of size 1.

Figures per process: the bytes autograd keeps for the backward (``saved_tensors_hooks``, each
storage once, DTensors by their local part: the activations proper), the peak growth of
resident memory over a forward and backward (``PeakRSS``: activations, the transient buffers,
gradients), and the parameters + gradients + AdamW state each process holds (its local
parameter elements x 4 bytes x 4). Target (issue 45): TP's activations per process at most
0.6x FSDP's.
"""

import argparse
import time

from _launch import relaunch_under_torchrun

if __name__ == "__main__":  # before the imports below: this process only relaunches
    relaunch_under_torchrun(2)

import torch
import torch.distributed as dist

from _common import (
    MiB,
    Row,
    barrier,
    gather_floats,
    is_main,
    median,
    parse_bench_args,
    print_table,
)
from _saved_bytes import SavedForBackward, state_bytes, storage_keys
from _system import PeakRSS
from tunelab.config.sections import SFTParallelismArgs
from tunelab.distributed import build_device_meshes, shard_model
from tunelab.distributed.tensor_parallel import parallelize_decoder
from tunelab.losses import CrossEntropyLoss
from tunelab.models import ModelArgs, TransformerDecoder
from tunelab.training.loop import batch_loss, output_layer

ACTIVATION_TARGET = 0.6


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None, help="unused (run_all.py passes a scratch dir)")
    return parse_bench_args(
        parser, smoke=["--seq-len", "256", "--dim", "128", "--vocab-size", "512", "--repeats", "1"]
    )


def build_model(args: argparse.Namespace) -> TransformerDecoder:
    """The Llama-shaped decoder, seeded (the same weights on both processes)."""
    torch.manual_seed(0)
    model = TransformerDecoder(
        ModelArgs(
            vocab_size=args.vocab_size,
            dim=args.dim,
            num_layers=args.layers,
            num_heads=args.dim // 64,
            num_kv_heads=max(2, args.dim // 256),
            intermediate_dim=args.dim * 7 // 2,
        )
    )
    model.attention_backend = "sdpa"
    return model


def row(seq_len: int, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """One row of random tokens, every token a target."""
    tokens = torch.randint(
        0, vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seed)
    )
    return {"tokens": tokens, "labels": tokens.clone()}


def step(model, loss_fn, output, batch) -> tuple[float, int, int]:
    """One forward and backward: (seconds, peak memory growth, bytes saved for backward)."""
    parameters = storage_keys(model.parameters())
    model.zero_grad(set_to_none=True)
    barrier()
    start = time.perf_counter()
    with PeakRSS() as peak:
        with SavedForBackward(lambda: parameters) as saved:
            loss, count = batch_loss(loss_fn, model, batch, output)
        (loss / count).backward()
    seconds = time.perf_counter() - start
    return seconds, peak.peak_growth, saved.bytes


def main() -> None:
    """Measure and print the table."""
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    fsdp = shard_model(build_model(args))
    tensor = build_model(args)
    meshes = build_device_meshes(torch.device("cpu"), SFTParallelismArgs(tensor_parallel_size=2))
    parallelize_decoder(tensor, meshes.tensor)
    shard_model(tensor, mesh=meshes.data_parallel)
    loss_fn = CrossEntropyLoss()
    paths = {
        # FSDP: each process its own row; TP: both processes the same row.
        "fsdp 2": (fsdp, output_layer(fsdp), row(args.seq_len, args.vocab_size, rank)),
        "tp 2": (tensor, output_layer(tensor), row(args.seq_len, args.vocab_size, 0)),
    }
    results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in paths}
    for repeat in range(args.repeats + 1):
        for name, (model, output, batch) in paths.items():
            measured = step(model, loss_fn, output, batch)
            if repeat:  # the first round warms up
                results[name].append(measured)
    figures = {}
    for name, runs in results.items():
        model = paths[name][0]
        figures[name] = {
            "saved": max(gather_floats(max(run[2] for run in runs))),
            "memory": max(gather_floats(max(run[1] for run in runs))),
            "state": max(gather_floats(state_bytes(model))),
            # Each process's share of the tokens per second: FSDP a row each, TP half a row.
            "throughput": min(
                gather_floats(
                    args.seq_len / (2 if name == "tp 2" else 1) / median(run[0] for run in runs)
                )
            ),
        }
    if is_main():
        ours, theirs = figures["tp 2"], figures["fsdp 2"]
        rows = []
        for key, label, target in (
            ("saved", "activations saved for backward, per process", ACTIVATION_TARGET),
            ("memory", "peak memory growth of a step, per process", None),
            ("state", "parameters + gradients + AdamW state, per process", None),
            ("throughput", "tokens/s per process", None),
        ):
            ratio = ours[key] / theirs[key]
            show = (
                (lambda v: f"{v:.0f}") if key == "throughput" else (lambda v: f"{v / MiB:.1f} MiB")
            )
            rows.append(
                Row(
                    label,
                    show(ours[key]),
                    show(theirs[key]),
                    f"{ratio:.2f}x",
                    f"<= {target}x" if target is not None else "-",
                    ratio <= target if target is not None else None,
                )
            )
        print_table(
            f"Tensor parallelism: tp 2 vs fsdp 2, one row of {args.seq_len} tokens per "
            "data-parallel group (tunelab = tp 2, alternative = fsdp 2)",
            rows,
            notes=[
                f"Llama-shaped decoder: dim {args.dim}, {args.layers} layers, "
                f"{args.dim // 64} query and {max(2, args.dim // 256)} K/V heads of 64, "
                f"feed-forward {args.dim * 7 // 2}, vocabulary {args.vocab_size}, fp32, sdpa, "
                "chunked cross-entropy; 2 processes (gloo), one thread each, both layouts on "
                "both processes. FSDP trains two rows per step (one per process), TP one "
                "(half a row's tokens per process): tokens/s per process is each process's "
                "share of the tokens over its step time.",
            ],
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
