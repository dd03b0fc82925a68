"""Context parallelism at 8k tokens: activation memory and throughput per process, cp 2 vs unsplit.

Run (2 processes under torchrun; the script relaunches itself):

    python bench/bench_context.py                  # one row of 8192 tokens
    python bench/bench_context.py --seq-len 1024   # a smoke size

A Llama-shaped decoder (dim 256, head_dim 64, 4 query heads and 1 K/V head, feed-forward 3.5 x
dim, 4 layers, vocabulary 4096; fp32 on CPU) trains one packed row (documents of 1000-3000
tokens, rotary positions restarting per document) with the chunked cross-entropy, through
the recipes' own ``batch_loss``. Both processes run both paths side by side, one thread each:

- unsplit: each process runs the whole row, as one process without context parallelism;
- cp 2: the row is split zig-zag over the 2 processes (``ContextParallel.shard``), keys and
  values all-gathered in every attention layer.

Figures per process: the peak growth of resident memory over a forward and backward
(``PeakRSS``: activations, the transient attention buffers, the K/V gathers and the
gradients), the bytes autograd keeps for the backward (``saved_tensors_hooks``, each storage
once: the activations proper), and tokens per second per process (the row's tokens a process
handles, 8192 unsplit and 4096 with cp 2, over the median step time of ``--repeats`` steps
after a warm-up, the two paths alternating). Targets (issue 30): memory at most 0.6x the
unsplit one, throughput per process at least 0.8x.
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
from _system import PeakRSS
from tunelab.distributed import build_context_parallel
from tunelab.losses import CrossEntropyLoss
from tunelab.models import ModelArgs, TransformerDecoder
from tunelab.modules.masks import positions_from_document_ids
from tunelab.training.loop import batch_loss, output_layer

MEMORY_TARGET = 0.6
THROUGHPUT_TARGET = 0.8


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="unused (run_all.py passes a scratch dir)")
    return parse_bench_args(
        parser, smoke=["--seq-len", "256", "--dim", "128", "--vocab-size", "512", "--repeats", "1"]
    )


def build_model(args: argparse.Namespace) -> TransformerDecoder:
    """The Llama-shaped decoder, seeded (the same weights on both processes)."""
    torch.manual_seed(0)
    model_args = ModelArgs(
        vocab_size=args.vocab_size,
        dim=args.dim,
        num_layers=args.layers,
        num_heads=args.dim // 64,
        num_kv_heads=max(1, args.dim // 256),
        intermediate_dim=args.dim * 7 // 2,
    )
    model = TransformerDecoder(model_args)
    model.attention_backend = "sdpa"
    return model


def packed_row(seq_len: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """One row of documents of 1000-3000 tokens, every token a target."""
    generator = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < seq_len:
        lengths.append(
            min(int(torch.randint(1000, 3001, (1,), generator=generator)), seq_len - total)
        )
        total += lengths[-1]
    document_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    tokens = torch.randint(0, vocab_size, (1, seq_len), generator=generator)
    return {
        "tokens": tokens,
        "labels": tokens.clone(),
        "document_ids": document_ids,
        "input_pos": positions_from_document_ids(document_ids),
    }


def step(model, loss_fn, output, batch, context) -> tuple[float, int, int]:
    """One forward and backward: (seconds, peak memory growth, bytes saved for backward)."""
    storages: dict[int, int] = {}
    parameters = {param.data_ptr() for param in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.zero_grad(set_to_none=True)
    barrier()
    start = time.perf_counter()
    with PeakRSS() as peak:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss, count = batch_loss(loss_fn, model, batch, output, context=context)
        (loss / count).backward()
    seconds = time.perf_counter() - start
    return seconds, peak.peak_growth, sum(storages.values())


def main() -> None:
    """Measure and print the table."""
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    context = build_context_parallel(2)
    model = build_model(args)
    output = output_layer(model)
    loss_fn = CrossEntropyLoss()
    whole = packed_row(args.seq_len, args.vocab_size)
    local = context.shard(whole)
    paths = {"unsplit": (whole, None), "cp 2": (local, context)}
    results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in paths}
    for repeat in range(args.repeats + 1):
        for name, (batch, ctx) in paths.items():
            measured = step(model, loss_fn, output, batch, ctx)
            if repeat:  # the first round warms up
                results[name].append(measured)
    figures = {}
    for name, runs in results.items():
        step_seconds = median(run[0] for run in runs)
        tokens = args.seq_len // (2 if name == "cp 2" else 1)
        figures[name] = {
            "memory": max(gather_floats(max(run[1] for run in runs))),
            "saved": max(gather_floats(max(run[2] for run in runs))),
            "throughput": min(gather_floats(tokens / step_seconds)),
        }
    if is_main():
        split, unsplit = figures["cp 2"], figures["unsplit"]
        rows = []
        for key, label, fmt, target, better_low in (
            ("memory", "peak memory growth of a step, per process", "mib", MEMORY_TARGET, True),
            ("saved", "activations saved for backward, per process", "mib", MEMORY_TARGET, True),
            ("throughput", "tokens/s per process", "tps", THROUGHPUT_TARGET, False),
        ):
            ratio = split[key] / unsplit[key]
            show = (lambda v: f"{v / MiB:.0f} MiB") if fmt == "mib" else (lambda v: f"{v:.0f}")
            rows.append(
                Row(
                    label,
                    show(split[key]),
                    show(unsplit[key]),
                    f"{ratio:.2f}x",
                    f"<= {target}x" if better_low else f">= {target}x",
                    ratio <= target if better_low else ratio >= target,
                )
            )
        print_table(
            f"Context parallelism: cp 2 vs unsplit at {args.seq_len} tokens (tunelab = cp 2, "
            "alternative = unsplit)",
            rows,
            notes=[
                f"Llama-shaped decoder: dim {args.dim}, {args.layers} layers, "
                f"{args.dim // 64} query heads and {max(1, args.dim // 256)} K/V head(s) of 64, "
                f"vocabulary {args.vocab_size}, fp32, sdpa, chunked cross-entropy; one packed row; "
                "2 processes (gloo), one thread each, both paths on both processes.",
                "Saved for backward, unsplit: "
                f"{unsplit['saved'] / args.seq_len / args.layers / 1024:.2f} KiB per token per "
                f"layer (embedding, logits and loss included in the total).",
            ],
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
