"""LoRA vs QLoRA (NF4 base) vs DoRA on the same model: memory, speed, export.

Run (it starts its own 2 processes under torchrun):

    python bench/bench_qlora.py                 # ~128 MB of fp32 base weights
    python bench/bench_qlora.py --size-mb 1100 --dim 2048

A Llama-style model (adapters on every linear layer but ``lm_head``) is built with the
recipes' ``build_model`` three ways, one after the other in the same 2 processes, FSDP2 over
2 ranks, fp32: plain LoRA, QLoRA (``quantize_base: nf4``) and DoRA (``use_dora: true``). For
each: the bytes of this rank's frozen linear weights (NF4: packed values, block scales and
factors; ``lm_head``, embeddings and norms are not counted: they stay in the training dtype
either way), the peak resident memory growth while building and training (``VmHWM``, see
``_common.PeakRSS``), and the median time of a training step (forward, backward, AdamW) and
its tokens/s. Then the export (adapter, then the merged model, written by both ranks) of LoRA
and QLoRA, barrier to barrier. QLoRA's frozen linear bytes over LoRA's is a stated figure,
not a target: it compares NF4's byte count with fp32's and holds by construction (~0.13x).
"""

import argparse
import shutil

from _launch import relaunch_under_torchrun

if __name__ == "__main__":  # before the imports below: this process only relaunches
    relaunch_under_torchrun(2)

import torch
import torch.nn.functional as F

import tunelab.peft as peft
from _common import (
    Row,
    gather_floats,
    is_main,
    mebibytes,
    median,
    print_table,
    seconds,
    time_collective,
)
from _models import SMOKE_SIZE, build_model, parse_size_args, prepare_workspace, size_parser
from _system import PeakRSS
from tunelab.checkpoint import CheckpointClient
from tunelab.config.lora import LoRAArgs
from tunelab.distributed import init_distributed
from tunelab.peft.nf4 import frozen_linear_bytes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = {"LoRA": {}, "QLoRA": {"quantize_base": "nf4"}, "DoRA": {"use_dora": True}}


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    parser = size_parser(__doc__.splitlines()[0], repeats=3, full=False)
    parser.set_defaults(size_mb=128, dim=512, vocab_size=2048)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    return parse_size_args(parser, smoke=(*SMOKE_SIZE, "--dim", "256"))


def measure(args, base, out, name: str) -> dict[str, float]:
    """Build one variant, train ``repeats + 1`` steps, export LoRA/QLoRA; its figures."""
    lora_args = LoRAArgs(rank=args.rank, alpha=2.0 * args.rank, targets=TARGETS)
    for key, value in VARIANTS[name].items():
        setattr(lora_args, key, value)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator
    )
    with PeakRSS() as memory:
        model = build_model(base, lora=lora_args)
        params = list(peft.get_adapter_params(model).values())
        optimizer = torch.optim.AdamW(params, lr=1e-4)

        def step() -> None:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        times = [time_collective(step) for _ in range(args.repeats + 1)][1:]  # first: warm-up
    figures = {
        "frozen": max(gather_floats(float(frozen_linear_bytes(model)))),
        "peak": max(gather_floats(float(memory.peak_growth))),
        "step": median(times),
    }
    if name != "DoRA":
        spec = LoRAArgs(
            rank=args.rank, alpha=2.0 * args.rank, targets=list(TARGETS), **VARIANTS[name]
        )
        client = CheckpointClient(
            out / name, model=model, optimizer=optimizer, lr_scheduler=None,
            base_checkpoint_dir=base, lora=spec,
        )  # fmt: skip
        figures["export"] = time_collective(lambda: client.export(0))
        client.close()
    return figures


def main() -> None:
    """Measure the three variants and print the table on rank 0."""
    args = parse_args()
    info = init_distributed("cpu")
    workspace = prepare_workspace(args, "tunelab_bench_qlora")
    results = {name: measure(args, workspace.base, workspace.out, name) for name in VARIANTS}
    tokens_per_step = args.batch_size * args.seq_len * info.world_size
    lora, qlora, dora = results["LoRA"], results["QLoRA"], results["DoRA"]
    ratio = qlora["frozen"] / lora["frozen"]
    rows = [
        # A stated figure, not a target: NF4's packed bytes (0.5 byte per value plus block
        # scales) against fp32's 4 bytes come to ~0.13x by construction; the measured
        # figures that can miss are the RSS, time and export rows.
        Row("frozen linear weights per rank, QLoRA (NF4 bytes by construction)",
            mebibytes(qlora["frozen"]), mebibytes(lora["frozen"]), f"{ratio:.3f}x", "-", None),
        Row("peak RSS growth per rank (build + steps), QLoRA", mebibytes(qlora["peak"]),
            mebibytes(lora["peak"]), f"{qlora['peak'] / lora['peak']:.2f}x", "-", None),
        Row("peak RSS growth per rank (build + steps), DoRA", mebibytes(dora["peak"]),
            mebibytes(lora["peak"]), f"{dora['peak'] / lora['peak']:.2f}x", "-", None),
        Row("step time, QLoRA", seconds(qlora["step"]), seconds(lora["step"]),
            f"{qlora['step'] / lora['step']:.2f}x", "stated", None),
        Row("step time, DoRA", seconds(dora["step"]), seconds(lora["step"]),
            f"{dora['step'] / lora['step']:.2f}x", "stated", None),
        Row("tokens/s, QLoRA", f"{tokens_per_step / qlora['step']:.0f}",
            f"{tokens_per_step / lora['step']:.0f}", f"{lora['step'] / qlora['step']:.2f}x",
            "-", None),
        Row("tokens/s, DoRA", f"{tokens_per_step / dora['step']:.0f}",
            f"{tokens_per_step / lora['step']:.0f}", f"{lora['step'] / dora['step']:.2f}x",
            "-", None),
        Row("export (adapter + merged model), QLoRA", seconds(qlora["export"]),
            seconds(lora["export"]), f"{qlora['export'] / lora['export']:.2f}x", "stated", None),
    ]  # fmt: skip
    if is_main():
        print_table(
            "LoRA vs QLoRA (NF4) vs DoRA, 2 ranks, fp32",
            rows,
            notes=[
                f"Model: {workspace.config['num_hidden_layers']} layers, dim {args.dim}, vocab "
                f"{args.vocab_size} (~{args.size_mb:.0f} MB fp32); adapters rank {args.rank} on "
                f"{', '.join(TARGETS)}; {args.batch_size} x {args.seq_len} tokens per rank per "
                f"step; medians of {args.repeats} steps after one warm-up.",
                "The alternative column is plain LoRA on the same model. On CPU NF4 weights are "
                "dequantized in every forward and backward, so QLoRA trades step time for memory.",
            ],
        )
        shutil.rmtree(workspace.root, ignore_errors=True)


if __name__ == "__main__":
    main()
