"""bench_grpo's TRL side: ``trl.GRPOTrainer`` on the same model, prompts and settings, timed.

Runs in each process of a ``torchrun`` launch (the Trainer uses DDP over gloo on 2 processes).
Its generation is ``transformers`` ``generate`` (the model's; sampled at temperature 1) with
``min_new_tokens`` equal to ``max_completion_length``: EOS is masked at every position, so every
completion is full length, as on tunelab's side. DAPO loss, beta 0, one iteration, LoRA r=8 on
every projection, fp32. Timed by a callback from ``on_step_begin`` to ``on_step_end``; the rollout
phase is ``_generate_and_score_completions``, the update the rest of the step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from _common import TRL_CPU_SETTINGS
from _grpo_results import StepClock, finish
from _grpo_work import EOS_ID, TARGETS, ended, parity_reward, word_tokenizer

SHARED_SETTINGS = {"loss_type": "dapo", "beta": 0.0, "num_iterations": 1, **TRL_CPU_SETTINGS}
"""``GRPOConfig`` settings of every GRPO bench's TRL side (bench_grpo, bench_agentic)."""
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": TARGETS,
        "task_type": "CAUSAL_LM"}  # fmt: skip
"""``peft.LoraConfig`` of the TRL sides: r=8 on every projection, as tunelab's."""


def parity(completions, **_) -> list[float]:
    """The bench's reward as a TRL reward function."""
    return parity_reward(completions)


def run(args: argparse.Namespace) -> None:
    """Train ``1 + steps`` steps with GRPOTrainer; rank 0 writes the result."""
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback

    from _system import peak_rss_bytes, reset_peak_rss
    from tunelab.distributed import init_distributed

    info = init_distributed("cpu")
    shape = json.loads(Path(args.shape_file).read_text())
    model = AutoModelForCausalLM.from_pretrained(
        shape["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    tokenizer = word_tokenizer(model.config.vocab_size)
    texts = [tokenizer.decode(prompt) for prompt in shape["prompts"]]
    dataset = Dataset.from_list([{"prompt": text} for text in texts])
    clock = StepClock()
    work: list[list[tuple[int, int]]] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            clock.start()
            work.append([])

        def on_step_end(self, *_, **__):
            clock.stop()
            steps = clock.steps[-1]
            steps["update_s"] = steps["step_s"] - steps["rollout_s"]

    config = trl.GRPOConfig(
        output_dir=str(Path(args.result).with_suffix("")),
        per_device_train_batch_size=args.prompts * args.num_generations // info.world_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_new_tokens,
        generation_kwargs={"min_new_tokens": args.max_new_tokens},  # EOS unreachable
        temperature=1.0,
        max_steps=1 + args.steps,
        ddp_find_unused_parameters=False,
        **SHARED_SETTINGS,
    )
    lora = LoraConfig(**LORA)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[parity],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[StepTimes()],
    )
    generate = trainer.model.generate

    def timed_generate(*gen_args, **gen_kwargs):
        start = time.perf_counter()
        out = generate(*gen_args, **gen_kwargs)
        clock.add("generate_s", time.perf_counter() - start)
        prompt_ids = gen_kwargs.get("input_ids", gen_args[0] if gen_args else None)
        attention = gen_kwargs.get("attention_mask", torch.ones_like(prompt_ids))
        for mask, new in zip(attention, out[:, prompt_ids.shape[1] :], strict=True):
            completion = len(ended(new.tolist(), {EOS_ID}))
            work[-1].append((int(mask.sum()), completion))
            clock.add("generated_tokens", completion)
        return out

    trainer.model.generate = timed_generate
    rollout = trainer._generate_and_score_completions

    def timed_rollout(*rollout_args, **rollout_kwargs):
        start = time.perf_counter()
        result = rollout(*rollout_args, **rollout_kwargs)
        clock.add("rollout_s", time.perf_counter() - start)
        return result

    trainer._generate_and_score_completions = timed_rollout
    load_peak = peak_rss_bytes()
    reset_peak_rss()
    trainer.train()
    finish(args.result, clock, work, load_peak, peak_rss_bytes())
