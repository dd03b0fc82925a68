"""Distillation: tunelab's distill_distributed against TRL's GKDTrainer, side by side (issue 43).

Run (``make bench`` installs trl with the ``bench`` extra):

    python bench/bench_distill.py              # loss memory at vocabulary 128k, then training
    python bench/bench_distill.py --smoke      # its smallest sizes: checks it runs

1. The loss alone, forward and backward, generalized JSD (beta 0.5): tunelab's
   ``GeneralizedJSDLoss`` on both models' hidden states, the output layers applied chunk by
   chunk, against TRL's ``GKDTrainer.generalized_jsd_loss`` on the two whole logits tensors
   (the output layers applied first, as ``GKDTrainer.compute_loss`` does). Vocabulary
   ``--vocab-size`` (128256), ``--loss-tokens`` scored positions, hidden size ``--dim``, fp32.
   Peak of live tensors (``_live_tensors``: every tensor torch allocates, counted op by op) and
   seconds. The issue's figure is 128k x 4096 tokens (``--loss-tokens 4096``: TRL's side then
   needs about 12 GiB); the default 1024 keeps ``make bench`` within a shared machine.
2. Training steps, offline (``lmbda`` 0) and on-policy (``lmbda`` 1), one process each, in fresh
   processes: the embedded tiny model (student, LoRA r=8 on every projection) and the 2x wider
   tiny teacher (``tunelab.assets.build_tiny_teacher``), the embedded chat data (``chat.jsonl``,
   the tokenizer's chat template), batch ``--batch-size``, beta 0.5, temperature 1,
   ``--max-new-tokens`` sampled tokens. tunelab: the real ``tunelab run distill_distributed``
   (its logged ``tokens_per_second``: scored tokens over the whole step, sampling included;
   median of the steps after the first, and ``peak_memory_gib``, the worker's peak RSS); TRL:
   ``GKDTrainer`` with the same models and settings (scored tokens counted in
   ``compute_loss``, step times from a callback; the worker's peak RSS, ``VmHWM``). Training
   runs before the loss part, so no process starts from a large one. The two do not score quite the same tokens: TRL's ChatML collator
   trains the last assistant turn only, tunelab every assistant turn; tokens/s normalises.

Targets (issue 43): tokens/s at least 1.3x TRL's, peak memory at most 0.5x; the loss's peak at
most 0.3x of materialising both logits.
"""

import argparse
import importlib.util
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import Row, launch_env, mebibytes, parse_bench_args, print_table, seconds
from _live_tensors import LiveTensorBytes

HERE = Path(__file__).resolve().parent
TUNELAB = str(Path(sys.executable).parent / "tunelab")
TARGETS = [
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
]  # fmt: skip


def parse_args() -> argparse.Namespace:
    """Command-line flags (the orchestrator's, and the TRL worker's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--loss-tokens", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="training steps (the first untimed)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--teacher-steps", type=int, default=60)
    parser.add_argument("--parts", default="loss,training", help="which parts to run")
    parser.add_argument("--modes", default="offline,on-policy", help="training modes to run")
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--lmbda", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--teacher", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    smoke = ["--vocab-size", "2048", "--loss-tokens", "64", "--dim", "32", "--steps", "2",
             "--batch-size", "2", "--max-new-tokens", "4", "--teacher-steps", "2",
             "--modes", "offline"]  # fmt: skip
    return parse_bench_args(parser, smoke)


# -- 1. the loss ----------------------------------------------------------------------------


def loss_rows(args: argparse.Namespace) -> list[Row]:
    """Peak live bytes and time of the loss's forward and backward, both sides."""
    import torch

    from tunelab.losses import GeneralizedJSDLoss, OutputLayer

    generator = torch.Generator().manual_seed(0)
    tokens, vocab, dim = args.loss_tokens, args.vocab_size, args.dim
    hidden = torch.randn(1, tokens, dim, generator=generator)
    teacher_hidden = torch.randn(1, tokens, dim, generator=generator)
    head = torch.randn(vocab, dim, generator=generator) / dim**0.5
    teacher_head = torch.randn(vocab, dim, generator=generator) / dim**0.5
    labels = torch.randint(0, vocab, (1, tokens), generator=generator)
    figures = {}

    def ours() -> None:
        h = hidden.clone().requires_grad_()
        loss = GeneralizedJSDLoss(beta=0.5)(
            h,
            teacher_hidden,
            labels,
            OutputLayer(lambda x: x @ head.T, False, vocab),
            OutputLayer(lambda x: x @ teacher_head.T, False, vocab),
        )
        (loss.loss_sum / tokens).backward()

    def trl() -> None:
        from trl.experimental.gkd import GKDTrainer

        h = hidden.clone().requires_grad_()
        student_logits = h @ head.T
        with torch.no_grad():
            teacher_logits = teacher_hidden @ teacher_head.T
        loss = GKDTrainer.generalized_jsd_loss(
            student_logits[:, :-1], teacher_logits[:, :-1], labels=labels[:, 1:], beta=0.5
        )
        loss.backward()

    sides = {"tunelab": ours}
    if importlib.util.find_spec("trl") is not None:
        sides["trl"] = trl
    for name, side in sides.items():
        side()  # warm-up
        with LiveTensorBytes() as tracker:
            start = time.perf_counter()
            side()
            figures[name] = (tracker.peak, time.perf_counter() - start)
    both_logits = 2 * tokens * vocab * 4
    ours_peak, ours_time = figures["tunelab"]
    where = f"vocabulary {vocab}, {tokens} tokens"
    rows = [
        Row(
            f"loss peak vs both fp32 logits ({where})",
            mebibytes(ours_peak),
            mebibytes(both_logits),
            f"{ours_peak / both_logits:.2f}x",
            "<= 0.3x",
            ours_peak <= 0.3 * both_logits,
        )
    ]
    if "trl" in figures:
        trl_peak, trl_time = figures["trl"]
        rows.append(
            Row(
                f"loss peak, fwd+bwd ({where})",
                mebibytes(ours_peak),
                mebibytes(trl_peak),
                f"{ours_peak / trl_peak:.2f}x",
                "<= 0.5x",
                ours_peak <= 0.5 * trl_peak,
            )
        )
        rows.append(
            Row(
                f"loss time, fwd+bwd ({where})",
                seconds(ours_time),
                seconds(trl_time),
                f"{trl_time / ours_time:.2f}x faster",
                "-",
                None,
            )
        )
    return rows


# -- 2. training ----------------------------------------------------------------------------


def tunelab_training(args: argparse.Namespace, teacher: Path, out: Path, lmbda: float) -> dict:
    """A real single-process ``tunelab run`` of tiny/distill on the chat data."""
    from tunelab._paths import assets_dir

    tiny = assets_dir() / "tiny"
    command = [
        TUNELAB, "run", "distill_distributed", "--config", "tiny/distill",
        f"output_dir={out}", f"teacher.path={teacher}", "~val_dataset",
        "dataset._component_=tunelab.data.chat_dataset", f"dataset.data_files={tiny}/chat.jsonl",
        "dataset.template=auto", "loss._component_=tunelab.losses.GeneralizedJSDLoss",
        "loss.beta=0.5", f"on_policy.lmbda={lmbda}",
        f"on_policy.max_new_tokens={args.max_new_tokens}", "lr_scheduler.num_warmup_steps=0",
        f"schedule.batch_size={args.batch_size}", f"schedule.max_steps_per_epoch={args.steps}",
        "checkpoint.save_every_n_steps=1000", "checkpoint.enable_async_checkpointing=false",
        "lora.dropout=0.0",
    ]  # fmt: skip
    subprocess.run(command, check=True, env=launch_env(1), capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tokens_per_second" in r]
    return {
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in steps[1:]),
        "peak_bytes": max(r["peak_memory_gib"] for r in steps) * 2**30,
    }


def trl_worker(args: argparse.Namespace) -> None:
    """GKDTrainer on the same models and data; writes its figures to ``--result``."""
    import datasets
    import torch
    import transformers
    from peft import LoraConfig
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from tunelab._paths import assets_dir

    tiny = assets_dir() / "tiny"
    scored, step_times = [], []

    class Counting(GKDTrainer):
        def compute_loss(self, model, inputs, *rest, **kwargs):
            scored.append(int((inputs["labels"][:, 1:] != -100).sum()))
            return super().compute_loss(model, inputs, *rest, **kwargs)

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            step_times.append(time.perf_counter() - self.start)

    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    config = GKDConfig(
        output_dir=str(Path(args.result).parent / "trl_out"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        lmbda=args.lmbda,
        beta=0.5,
        temperature=1.0,
        max_new_tokens=args.max_new_tokens,
        max_length=128,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        disable_dropout=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Counting(
        model=transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32),
        teacher_model=transformers.AutoModelForCausalLM.from_pretrained(
            args.teacher, dtype=torch.float32
        ),
        args=config,
        train_dataset=datasets.load_dataset("json", data_files=str(tiny / "chat.jsonl"))["train"],
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS),
        callbacks=[Timer()],
    )
    trainer.train()
    rates = [tokens / step for tokens, step in zip(scored[1:], step_times[1:], strict=False)]
    Path(args.result).write_text(
        json.dumps({"tokens_per_second": statistics.median(rates), "peak_bytes": _peak_rss()})
    )


def _peak_rss() -> int:
    # This process's own high-water mark (VmHWM: reset at exec; ru_maxrss may carry the
    # launching process's peak across fork and exec on Linux).
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def training_rows(args: argparse.Namespace, scratch: Path) -> list[Row]:
    """Offline and on-policy: tokens/s and peak memory, tunelab against GKDTrainer."""
    from tunelab.assets.build_tiny_teacher import build_teacher

    teacher = build_teacher(scratch / "teacher", steps=args.teacher_steps)
    has_trl = importlib.util.find_spec("trl") is not None
    rows = []
    for mode, lmbda in (("offline", 0.0), ("on-policy", 1.0)):
        if mode not in args.modes.split(","):
            continue
        ours = tunelab_training(args, teacher, scratch / f"tunelab_{mode}", lmbda)
        theirs = None
        if has_trl:
            result = scratch / f"trl_{mode}.json"
            subprocess.run(
                [sys.executable, __file__, "--worker", "trl", "--lmbda", str(lmbda),
                 "--teacher", str(teacher), "--result", str(result),
                 "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                 "--max-new-tokens", str(args.max_new_tokens)],
                check=True, env=launch_env(1), capture_output=True, text=True,
            )  # fmt: skip
            theirs = json.loads(result.read_text())
        speed = ours["tokens_per_second"]
        rows.append(
            Row(
                f"{mode} tokens/s",
                f"{speed:.0f}",
                f"{theirs['tokens_per_second']:.0f}" if theirs else "no trl",
                f"{speed / theirs['tokens_per_second']:.2f}x" if theirs else "-",
                ">= 1.3x",
                speed >= 1.3 * theirs["tokens_per_second"] if theirs else None,
            )
        )
        peak = ours["peak_bytes"]
        rows.append(
            Row(
                f"{mode} peak memory (RSS)",
                mebibytes(peak),
                mebibytes(theirs["peak_bytes"]) if theirs else "no trl",
                f"{peak / theirs['peak_bytes']:.2f}x" if theirs else "-",
                "<= 0.5x",
                peak <= 0.5 * theirs["peak_bytes"] if theirs else None,
            )
        )
    return rows


def main() -> None:
    """Run both parts and print one table."""
    args = parse_args()
    if args.worker == "trl":
        trl_worker(args)
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        parts = args.parts.split(",")
        # Training first: its processes start from this one while it is still small.
        rows = training_rows(args, Path(scratch)) if "training" in parts else []
        rows += loss_rows(args) if "loss" in parts else []
    print_table(
        "distill: tunelab distill_distributed vs TRL GKDTrainer",
        rows,
        notes=[
            f"loss: fp32, hidden size {args.dim}; training: 1 process, batch {args.batch_size}, "
            f"{args.steps} steps (first untimed), {args.max_new_tokens} new tokens on-policy, "
            "LoRA r=8 on every projection, generalized JSD beta 0.5."
        ],
    )


if __name__ == "__main__":
    main()
