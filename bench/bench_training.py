"""Training throughput, memory, per-phase times and MFU of the LoRA SFT and DPO recipes.

Run (it launches torchrun itself, once per row, with 1 and with 2 processes):

    python bench/bench_training.py
    python bench/bench_training.py --steps 10 --seq-len 512 --wide-layers 4

Each row drives the library pieces the recipes ``lora_finetune_distributed`` and
``lora_dpo_distributed`` run, in their order, with ``time.perf_counter`` around each phase:
``build_model`` (meta build, LoRA r=8 on every projection as in ``configs/tiny``, FSDP2 over
the ranks, sharded load), ``adamw``, the step (``forward``, the recipe's loss, ``backward``
scaled as ``sft_backward`` / ``preference_backward`` do, ``optimizer_step`` with clipping)
and an async ``CheckpointClient.save`` after every step (the worst case
``save_every_n_steps: 1``; its blocked time is the checkpoint column). Batches are random
token ids made here (the data pipeline is not what is timed): SFT rows train on every token;
DPO rows hold chosen then rejected rows sharing a prompt of half the sequence.

Phase times are per step, the slowest rank, median over the timed steps (one untimed
warm-up step first). Tokens/s counts every processed position over forward + backward +
optimizer, all ranks together. Peak RSS is the largest rank's peak resident set during the
steps (reset after the model is built). MFU: model FLOPs (see ``_flops.py`` for the formulas)
per second over the peak of a 2048 x 2048 fp32 ``torch.mm`` run on every rank at once in the
same job, before and after the steps (the higher counts). Target: MFU >= 50% for the rows of
the model whose layers are >= 1024 wide ("wide").
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from _common import GiB, Row, gather_floats, is_main, median, print_table, torchrun
from _flops import lora_dpo_flops_per_token, lora_sft_flops_per_token, peak_matmul_flops
from _models import build_model, llama_config, write_hf_checkpoint
from _system import peak_rss_bytes, reset_peak_rss

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHASES = ("reference", "forward", "backward", "optimizer", "checkpoint")


def parse_args() -> argparse.Namespace:
    """Command-line flags (the orchestrator's, plus the worker's own)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256, help="width of the small model")
    parser.add_argument("--layers", type=int, default=2, help="blocks of the small model")
    parser.add_argument("--vocab-size", type=int, default=4096, help="small model vocabulary")
    parser.add_argument("--wide-dim", type=int, default=1024, help="width of the MFU model")
    parser.add_argument("--wide-layers", type=int, default=2, help="blocks of the MFU model")
    parser.add_argument("--wide-vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4, help="rows per rank and step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row")
    parser.add_argument("--nprocs", default="1,2", help="process counts to run")
    parser.add_argument("--recipes", default="sft,dpo", help="sft, dpo or both")
    parser.add_argument("--models", default="small,wide", help="small, wide or both")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recipe", default="sft", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-reshard", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def make_batch(recipe: str, batch_size: int, seq_len: int, vocab_size: int, step: int):
    """Random token ids of one rank's step; DPO rows are chosen rows, then rejected rows."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    labels = tokens.clone()
    if recipe == "dpo":
        pairs = batch_size // 2
        tokens[pairs:, : seq_len // 2] = tokens[:pairs, : seq_len // 2]  # a shared prompt
        labels = tokens.clone()
        labels[:, : seq_len // 2] = -100  # only completions are scored
    return {"tokens": tokens, "labels": labels}


class Laps:
    """Seconds between successive :meth:`lap` calls, by phase (0 for phases not run)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._clock = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Record the time since the previous lap as ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] = now - self._clock
        self._clock = now


def worker(args: argparse.Namespace) -> None:
    """One row: build, train ``1 + steps`` steps with timed phases, write the result JSON."""
    import tunelab.peft as peft
    from tunelab.checkpoint import CheckpointClient, LoRASpec
    from tunelab.config.recipe_args import LoRAArgs
    from tunelab.distributed import init_distributed
    from tunelab.losses import CrossEntropyLoss, DPOLoss
    from tunelab.training import (
        ReferenceModel,
        adamw,
        forward,
        global_token_count,
        optimizer_step,
        policy_forward,
    )

    info = init_distributed("cpu")
    torch.manual_seed(0)
    model = build_model(
        args.checkpoint,
        lora=LoRAArgs(rank=8, alpha=16.0, targets=TARGETS),
        reshard_after_forward=not args.no_reshard,
    )
    trainable = list(peft.get_adapter_params(model).values())
    optimizer = adamw(trainable, lr=1e-4, weight_decay=0.0)
    out = Path(args.checkpoint).parent / f"out_{args.recipe}_{info.world_size}"
    client = CheckpointClient(
        out,
        model=model,
        optimizer=optimizer,
        lr_scheduler=None,
        base_checkpoint_dir=args.checkpoint,
        lora=LoRASpec(rank=8, alpha=16.0, targets=tuple(peft.lora_target_names(model))),
        enable_async=True,
        keep_last_n=1,
    )
    reference = ReferenceModel(model, freeze_current_adapter=False)
    sft_loss, dpo_loss = CrossEntropyLoss(), DPOLoss(beta=0.1)
    peak_before = peak_matmul_flops()
    reset_peak_rss()
    model.train()
    vocab_size = model.args.vocab_size
    times = torch.zeros(1 + args.steps, len(PHASES), dtype=torch.float64)
    for step in range(1 + args.steps):
        batch = make_batch(args.recipe, args.batch_size, args.seq_len, vocab_size, step)
        laps = Laps()
        if args.recipe == "sft":
            num_tokens = global_token_count([batch])
            loss_sum, _ = sft_loss(forward(model, batch), batch["labels"])
            laps.lap("forward")
            (loss_sum * info.world_size / num_tokens).backward()
        else:
            ref = reference.logps([batch])[0]
            laps.lap("reference")
            pairs = torch.tensor(float(args.batch_size // 2))
            global_pairs = pairs * info.world_size  # every rank holds the same number
            policy = policy_forward(model, batch)
            losses, _, _ = dpo_loss(
                policy.chosen_logps,
                policy.rejected_logps,
                ref.chosen_logps,
                ref.rejected_logps,
                policy.chosen_lengths,
                policy.rejected_lengths,
            )
            laps.lap("forward")
            (losses.sum() * info.world_size / global_pairs).backward()
        laps.lap("backward")
        optimizer_step(optimizer, trainable, clip_grad_norm=1.0, lr_scheduler=None)
        laps.lap("optimizer")
        client.save(step + 1, 0, {"step": step + 1})
        laps.lap("checkpoint")
        times[step] = torch.tensor([laps.seconds[phase] for phase in PHASES])
    client.close()
    peak_after = peak_matmul_flops()
    if dist.is_initialized():
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    peak_rss = max(gather_floats(float(peak_rss_bytes())))
    machine_peak = max(sum(gather_floats(peak_before)), sum(gather_floats(peak_after)))
    adapter_params = sum(param.numel() for param in trainable)  # global sizes of DTensors
    flops = (lora_sft_flops_per_token if args.recipe == "sft" else lora_dpo_flops_per_token)(
        model.args, adapter_params, args.seq_len
    )
    if is_main():
        timed = times[1:]
        phase_s = {phase: median(timed[:, i].tolist()) for i, phase in enumerate(PHASES)}
        compute_s = median((timed[:, :4].sum(dim=1)).tolist())  # reference..optimizer
        tokens = args.batch_size * args.seq_len * info.world_size
        result = {
            "phase_s": phase_s,
            "step_s": compute_s,
            "tokens_per_s": tokens / compute_s,
            "model_flops_per_s": flops * tokens / compute_s,
            "peak_flops_per_s": machine_peak,
            "peak_rss_bytes": peak_rss,
        }
        Path(args.result).write_text(json.dumps(result))
        shutil.rmtree(out, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()  # rank 0 writes results first; tear down only once all are done
        dist.destroy_process_group()


def orchestrate(args: argparse.Namespace) -> None:
    """Write the two synthetic models, launch one torchrun per row, print the table."""
    root = Path(args.dir or tempfile.gettempdir()) / "tunelab_bench_training"
    shutil.rmtree(root, ignore_errors=True)
    models = {
        "small": llama_config(dim=args.dim, num_layers=args.layers, vocab_size=args.vocab_size),
        "wide": llama_config(
            dim=args.wide_dim, num_layers=args.wide_layers, vocab_size=args.wide_vocab_size
        ),
    }
    models = {name: models[name] for name in args.models.split(",")}
    for name, config in models.items():
        write_hf_checkpoint(root / name / "base", config)
    nprocs = [int(n) for n in args.nprocs.split(",")]
    recipes = args.recipes.split(",")
    rows = []
    for model_name, recipe, nproc, no_reshard in row_plan(models, recipes, nprocs):
        result_path = root / f"{model_name}_{recipe}_{nproc}_{int(no_reshard)}.json"
        worker_args = [
            "--worker", "--recipe", recipe,
            "--checkpoint", str(root / model_name / "base"), "--result", str(result_path),
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
            "--steps", str(args.steps), *(["--no-reshard"] if no_reshard else []),
        ]  # fmt: skip
        done = torchrun(__file__, worker_args, nproc, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-6000:], file=sys.stderr)
            raise subprocess.CalledProcessError(done.returncode, "torchrun worker")
        result = json.loads(result_path.read_text())
        rows.append(table_row(model_name, models[model_name], recipe, nproc, no_reshard, result))
    shutil.rmtree(root, ignore_errors=True)
    print_table(
        "Training: LoRA SFT and DPO throughput, memory, phases and MFU",
        rows,
        [
            f"seq_len {args.seq_len}, {args.batch_size} rows per rank and step, LoRA r=8 on "
            f"{', '.join(TARGETS)}, fp32, median of {args.steps} steps; times per step, "
            "slowest rank; checkpoint: async save after every step (blocked time); "
            "tunelab = model FLOP/s achieved, alternative = peak fp32 matmul FLOP/s of the "
            "same processes, ratio = MFU."
        ],
        extra_columns=["tokens/s", "peak RSS/rank", "ref fwd", "fwd", "bwd", "opt", "ckpt"],
    )


def row_plan(
    models: dict, recipes: list[str], nprocs: list[int]
) -> list[tuple[str, str, int, bool]]:
    """``(model, recipe, processes, no_reshard)`` of each row, in table order.

    Every model, recipe and process count runs with the recipes' default
    ``reshard_after_forward: true``; the wide SFT model on several processes also runs with
    ``false`` (the frozen base is gathered once per step instead of twice).
    """
    plan = []
    for model_name in models:
        for recipe in recipes:
            for nproc in nprocs:
                plan.append((model_name, recipe, nproc, False))
                if model_name == "wide" and recipe == "sft" and nproc > 1:
                    plan.append((model_name, recipe, nproc, True))
    return plan


def table_row(
    model_name: str, config: dict, recipe: str, nproc: int, no_reshard: bool, result: dict
) -> Row:
    """One table line from a worker's result."""
    mfu = result["model_flops_per_s"] / result["peak_flops_per_s"]
    wide = model_name == "wide" and config["hidden_size"] >= 1024
    phases = result["phase_s"]
    return Row(
        figure=(
            f"{'lora_finetune' if recipe == 'sft' else 'lora_dpo'}, {nproc} proc, "
            f"d={config['hidden_size']} L={config['num_hidden_layers']}"
            + (", reshard_after_forward: false" if no_reshard else "")
        ),
        tunelab=f"{result['model_flops_per_s'] / 1e9:.1f} GFLOP/s",
        alternative=f"{result['peak_flops_per_s'] / 1e9:.1f} GFLOP/s",
        ratio=f"{100 * mfu:.1f}% MFU",
        target=">= 50% MFU" if wide else "-",
        met=(mfu >= 0.5) if wide else None,
        extra=(
            f"{result['tokens_per_s']:.0f}",
            f"{result['peak_rss_bytes'] / GiB:.2f} GiB",
            *(
                "-"
                if recipe == "sft" and phase == "reference"
                else f"{1000 * phases[phase]:.0f} ms"
                for phase in PHASES
            ),
        ),
    )


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        orchestrate(arguments)
