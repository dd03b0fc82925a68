"""KTO training throughput: tunelab's kto_distributed step against TRL's KTOTrainer, side by side.

Run (each side in its own process, one after the other, ``--rounds`` times, best kept):

    python bench/bench_kto.py
    python bench/bench_kto.py --steps 16 --batch-size 16 --rounds 3

Both sides train the same LoRA (r=8, alpha=16, dropout 0, every projection, as ``tiny/kto``) on
the embedded tiny model in fp32, on the same rows: the embedded ``kto.jsonl`` as chat messages,
rendered by the tokenizer's own chat template on both sides, ``--batch-size`` labelled rows per
step, a live reference (the base with adapters disabled), ``beta`` 0.1, AdamW with clipping at
1.0. Each side does the same work per row: the policy's log-probs (with gradient) of the
completion and (without) of its mismatched pair, and the reference's of both; tunelab computes
the prompt a row shares with its mismatched pair once in each pass.

- ``tunelab``: the library pieces ``recipes/kto_distributed.py`` runs, in its order
  for a step of one micro-batch (``step_references``, ``kto_forward``, ``step_kl``,
  ``kto_loss``, ``OptimizerStep``), with the recipe's defaults (chunked output layer, fused
  AdamW) on one process, timed around each optimizer step;
- ``TRL``: ``trl.KTOTrainer`` (sequential sampling, as it requires) on the same checkpoint
  loaded by ``transformers`` (SDPA) with a PEFT ``LoraConfig``; tuned as a careful user would
  for fp32: no bf16 autocast, no gradient checkpointing, logging and saving off; each step
  timed from the Trainer's ``on_step_begin`` to ``on_step_end``.

Each side runs with ``--threads`` intra-op threads (default 1): on this 2-core machine shared
with other jobs, 2 threads per process made a tunelab step about 30x slower than 1 (7 s
against 0.2 s, measured) and the figures noise.

Tokens/s: the tokens (prompt + completion, no padding) of the labelled rows of the timed steps
over their summed time (one untimed warm-up step first); both sides render the same text, so a
row has the same tokens on both. The ratio is the claim; the absolute figures depend on the
machine and its load.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from _common import (
    LORA_TARGETS,
    add_trainer_bench_args,
    bench_model_dir,
    parse_bench_args,
    print_table,
    run_trainer_rounds,
    throughput_rows,
    tiny_dir,
    trainer_bench_main,
    trl_settings,
)

TARGET_RATIO = 1.3


def parse_args() -> argparse.Namespace:
    """Command-line flags (the orchestrator's, plus the worker's own)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side")
    parser.add_argument("--batch-size", type=int, default=8, help="labelled rows per step")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--rows", type=int, default=400, help="rows of kto.jsonl used")
    add_trainer_bench_args(parser)
    smoke = ["--steps", "1", "--batch-size", "2", "--rows", "16", "--rounds", "1"]
    return parse_bench_args(parser, smoke)


def write_chat_rows(path: Path, count: int) -> None:
    """The embedded KTO rows as chat messages (rendered by the chat template on both sides)."""
    lines = (tiny_dir() / "kto.jsonl").read_text().splitlines()[:count]
    with path.open("w") as out:
        for line in lines:
            row = json.loads(line)
            chat = {
                "prompt": [{"role": "user", "content": row["prompt"]}],
                "completion": [{"role": "assistant", "content": row["completion"]}],
                "label": row["label"],
            }
            out.write(json.dumps(chat) + "\n")


def tunelab_worker(args: argparse.Namespace) -> dict:
    """The tunelab side: the recipe's step, timed per optimizer step."""
    from functools import partial

    import torch
    from torch.utils.data import DataLoader

    import tunelab.peft as peft
    from tunelab.config.lora import LoRAArgs
    from tunelab.data import kto_dataset, load_tokenizer, padded_collate_kto
    from tunelab.losses import KTOLoss
    from tunelab.training import (
        OptimizerStep,
        ReferenceModel,
        adamw,
        global_pair_count,
        kto_forward,
        kto_loss,
        load_model,
        output_layer,
        step_kl,
        step_references,
    )

    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.model_dir)
    dataset = kto_dataset(
        tokenizer, source=args.data, template="auto", max_seq_len=args.max_length,
        cache_dir=str(Path(args.result).parent / "cache"),
    )  # fmt: skip
    loader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
        collate_fn=partial(padded_collate_kto, pad_id=tokenizer.pad_id),
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    lora = LoRAArgs(rank=8, alpha=16.0, dropout=0.0, targets=LORA_TARGETS, use_rslora=False)
    model = load_model(args.model_dir, device=torch.device("cpu"), dtype=torch.float32, lora=lora)
    model.train()
    trainable = list(peft.get_adapter_params(model).values())
    optimizer_step = OptimizerStep(
        adamw(trainable, lr=1e-4, weight_decay=0.0), trainable, clip_grad_norm=1.0
    )
    reference = ReferenceModel(model, freeze_current_adapter=False)
    output = output_layer(model)
    loss_fn = KTOLoss(beta=0.1)
    seconds, cpu_seconds, tokens = 0.0, 0.0, 0
    batches = iter(loader)
    for step in range(1 + args.steps):
        micro_batches = [next(batches)]
        began, began_cpu = time.perf_counter(), time.process_time()
        references = step_references(model, micro_batches, loss_fn, reference, None, output=output)
        # One micro-batch a step, as the recipe's default: one policy forward of both halves.
        policy, mismatched = kto_forward(model, micro_batches[0], output=output)
        kl = step_kl([mismatched], references)
        num_rows = global_pair_count(micro_batches)
        for batch, ref in zip(micro_batches, references, strict=True):
            losses, sums = kto_loss(loss_fn, policy, ref, batch["desirable"], kl)
            (losses.sum() / num_rows).backward()
        optimizer_step(loss=float(sums["loss"]), step=step + 1)
        elapsed, elapsed_cpu = time.perf_counter() - began, time.process_time() - began_cpu
        if step > 0:  # the first step warms up
            seconds += elapsed
            cpu_seconds += elapsed_cpu
            rows = batch["tokens"][: num_rows.int().item()]
            tokens += int((rows != tokenizer.pad_id).sum())
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": tokens}


def trl_worker(args: argparse.Namespace) -> dict:
    """The TRL side: KTOTrainer's own loop, each step timed by a callback."""
    import datasets
    import torch
    import trl
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    dataset = datasets.Dataset.from_list(rows)
    step_seconds: list[float] = []
    step_cpu_seconds: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.began, self.began_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            step_seconds.append(time.perf_counter() - self.began)
            step_cpu_seconds.append(time.process_time() - self.began_cpu)

    config = trl.KTOConfig(**trl_settings(args), beta=0.1)
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
    )
    trainer = trl.KTOTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[StepTimes()],
    )
    trainer.train()
    # Sequential sampling: step k trains rows [k B, (k + 1) B) of the tokenized dataset.
    tokenized = trainer.train_dataset
    lengths = [
        min(len(p) + len(c), args.max_length)
        for p, c in zip(tokenized["prompt_ids"], tokenized["completion_ids"], strict=True)
    ]
    batch = args.batch_size
    tokens = sum(lengths[batch : batch * (1 + args.steps)])
    return {
        "seconds": sum(step_seconds[1:]),
        "cpu_seconds": sum(step_cpu_seconds[1:]),
        "tokens": tokens,
    }


def orchestrate(args: argparse.Namespace) -> None:
    """Run both sides ``--rounds`` times, the order alternating, and print the table."""
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench_kto_"))
    scratch.mkdir(parents=True, exist_ok=True)
    data = scratch / "kto_chat.jsonl"
    write_chat_rows(data, args.rows)
    model_dir = bench_model_dir(args.model, scratch)
    load_before = os.getloadavg()[0]
    results = run_trainer_rounds(__file__, args, data, model_dir, scratch)
    figure = f"KTO step, {args.model} model, 1 process: tokens/s (tunelab / TRL KTOTrainer)"
    rows, round_notes = throughput_rows(figure, results, TARGET_RATIO)
    notes = [
        f"{args.model} model ({model_dir.name}), LoRA r=8 on every projection, fp32, "
        f"{args.batch_size} labelled rows a step, {args.steps} timed steps after one warm-up, "
        f"{args.rounds} round(s), the order alternating; {os.cpu_count()} cores, one process "
        f"per side with {args.threads} intra-op thread(s), one side at a time; load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after.",
        *round_notes,
    ]
    print_table("KTO: tunelab kto_distributed vs TRL KTOTrainer", rows, notes)


def main() -> None:
    """Worker or orchestrator, by the flags."""
    workers = {"tunelab": tunelab_worker, "TRL": trl_worker}
    trainer_bench_main(parse_args(), workers, orchestrate)


if __name__ == "__main__":
    main()
