"""Reward-model training throughput: tunelab's reward_model_distributed step against TRL's RewardTrainer.

Run (each side in its own process, one after the other, ``--rounds`` times, best kept):

    python bench/bench_reward_model.py
    python bench/bench_reward_model.py --steps 16 --batch-size 16 --rounds 3

Both sides train the same reward model on the embedded tiny model in fp32: a fresh score head
and LoRA (r=8, alpha=16, dropout 0, every projection, as ``tiny/reward_model``; the head
trains whole), on the same pairs: the embedded ``preference.jsonl`` as chat messages rendered
by the tokenizer's own chat template on both sides, ``--batch-size`` pairs per step, the
Bradley-Terry loss, AdamW with clipping at 1.0.

- ``tunelab``: the library pieces ``recipes/reward_model_distributed.py`` runs, in its order
  (``reward_loss`` over one forward of the chosen and rejected rows, ``OptimizerStep``), on
  one process, timed around each optimizer step;
- ``TRL``: ``trl.RewardTrainer`` on the same checkpoint loaded by ``transformers``
  (``AutoModelForSequenceClassification``, SDPA) with a PEFT ``LoraConfig`` (``SEQ_CLS``, the
  score head in ``modules_to_save``); tuned as a careful user would for fp32: no bf16
  autocast, no gradient checkpointing, logging and saving off; each step timed from the
  Trainer's ``on_step_begin`` to ``on_step_end``.

Tokens/s: the tokens (chosen + rejected, no padding) of the pairs of the timed steps over their
summed time (one untimed warm-up step first); TRL's are counted from the attention masks of
the batches it trained on. The ratio is the claim; the absolute figures depend on the machine
and its load.
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
    parser.add_argument("--batch-size", type=int, default=8, help="preference pairs per step")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--rows", type=int, default=400, help="pairs of preference.jsonl used")
    add_trainer_bench_args(parser)
    smoke = ["--steps", "1", "--batch-size", "2", "--rows", "16", "--rounds", "1"]
    return parse_bench_args(parser, smoke)


def write_chat_pairs(path: Path, count: int) -> None:
    """The embedded preference pairs as chat messages (rendered by the chat template)."""
    lines = (tiny_dir() / "preference.jsonl").read_text().splitlines()[:count]
    with path.open("w") as out:
        for line in lines:
            row = json.loads(line)
            chat = {
                "prompt": [{"role": "user", "content": row["prompt"]}],
                "chosen": [{"role": "assistant", "content": row["chosen"]}],
                "rejected": [{"role": "assistant", "content": row["rejected"]}],
            }
            out.write(json.dumps(chat) + "\n")


def tunelab_worker(args: argparse.Namespace) -> dict:
    """The tunelab side: the recipe's step, timed per optimizer step."""
    from functools import partial

    import torch
    from torch.utils.data import DataLoader

    from tunelab.config.lora import LoRAArgs
    from tunelab.config.sections import RewardModelSetupArgs
    from tunelab.data import load_tokenizer, padded_collate_dpo, preference_dataset
    from tunelab.losses.reward import BradleyTerryLoss
    from tunelab.training import OptimizerStep, adamw, build_model, global_pair_count, reward_loss

    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.model_dir)
    dataset = preference_dataset(
        tokenizer, source=args.data, template="auto", max_seq_len=args.max_length,
        cache_dir=str(Path(args.result).parent / "cache"),
    )  # fmt: skip
    loader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
        collate_fn=partial(padded_collate_dpo, pad_id=tokenizer.pad_id),
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    lora = LoRAArgs(rank=8, alpha=16.0, dropout=0.0, targets=LORA_TARGETS, use_rslora=False)
    model = build_model(
        RewardModelSetupArgs(path=args.model_dir), device=torch.device("cpu"), lora=lora
    )
    model.train()
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer_step = OptimizerStep(
        adamw(trainable, lr=1e-4, weight_decay=0.0), trainable, clip_grad_norm=1.0
    )
    loss_fn = BradleyTerryLoss()
    seconds, cpu_seconds, tokens = 0.0, 0.0, 0
    batches = iter(loader)
    for step in range(1 + args.steps):
        batch = next(batches)
        began, began_cpu = time.perf_counter(), time.process_time()
        num_pairs = global_pair_count([batch])
        losses, sums = reward_loss(loss_fn, model, batch, tokenizer.pad_id)
        (losses.sum() / num_pairs).backward()
        optimizer_step(loss=float(sums["loss"]), step=step + 1)
        elapsed, elapsed_cpu = time.perf_counter() - began, time.process_time() - began_cpu
        if step > 0:  # the first step warms up
            seconds += elapsed
            cpu_seconds += elapsed_cpu
            tokens += int((batch["tokens"] != tokenizer.pad_id).sum())
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": tokens}


def trl_worker(args: argparse.Namespace) -> dict:
    """The TRL side: RewardTrainer's own loop, each step timed by a callback."""
    import datasets
    import torch
    import trl
    from peft import LoraConfig
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_dir, num_labels=1, pad_token_id=tokenizer.pad_token_id,
        dtype=torch.float32, attn_implementation="sdpa",
    )  # fmt: skip
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    dataset = datasets.Dataset.from_list(rows)
    step_seconds: list[float] = []
    step_cpu_seconds: list[float] = []
    step_tokens: list[int] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.began, self.began_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            step_seconds.append(time.perf_counter() - self.began)
            step_cpu_seconds.append(time.process_time() - self.began_cpu)

    class CountingRewardTrainer(trl.RewardTrainer):
        def compute_loss(self, model, inputs, *rest, **kwargs):
            step_tokens.append(int(inputs["attention_mask"].sum()))
            return super().compute_loss(model, inputs, *rest, **kwargs)

    config = trl.RewardConfig(**trl_settings(args))
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="SEQ_CLS",
        modules_to_save=["score"],
    )  # fmt: skip
    trainer = CountingRewardTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[StepTimes()],
    )
    trainer.train()
    return {
        "seconds": sum(step_seconds[1:]),
        "cpu_seconds": sum(step_cpu_seconds[1:]),
        "tokens": sum(step_tokens[1:]),
    }


def orchestrate(args: argparse.Namespace) -> None:
    """Run both sides ``--rounds`` times, the order alternating, and print the table."""
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench_reward_model_"))
    scratch.mkdir(parents=True, exist_ok=True)
    data = scratch / "preference_chat.jsonl"
    write_chat_pairs(data, args.rows)
    model_dir = bench_model_dir(args.model, scratch)
    load_before = os.getloadavg()[0]
    results = run_trainer_rounds(__file__, args, data, model_dir, scratch)
    figure = (
        f"reward-model step, {args.model} model, 1 process: tokens/s (tunelab / TRL RewardTrainer)"
    )
    rows, round_notes = throughput_rows(figure, results, TARGET_RATIO)
    notes = [
        f"{args.model} model ({model_dir.name}), fresh score head + LoRA r=8 on every projection, "
        f"fp32, {args.batch_size} pairs a step, {args.steps} timed steps after one warm-up, "
        f"{args.rounds} round(s), the order alternating; {os.cpu_count()} cores, one process "
        f"per side with {args.threads} intra-op thread(s), one side at a time; load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after.",
        *round_notes,
    ]
    print_table("Reward model: tunelab reward_model_distributed vs TRL RewardTrainer", rows, notes)


def main() -> None:
    """Worker or orchestrator, by the flags."""
    workers = {"tunelab": tunelab_worker, "TRL": trl_worker}
    trainer_bench_main(parse_args(), workers, orchestrate)


if __name__ == "__main__":
    main()
