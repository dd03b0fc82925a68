"""bench_grpo's tunelab side: the pieces ``grpo_distributed`` calls, in its order, timed.

Runs in each process of a ``torchrun`` launch (1 or 2 processes). Each step: this rank's share
of the step's prompts through ``GroupSampler.sample`` (the built-in engine, the recipe's rollout
defaults), then ``policy_gradient_pass`` with DAPO's token-mean ``GRPOLoss`` (beta 0) through the
chunked output layer, then ``OptimizerStep``: one iteration, as the recipe runs it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from _grpo_results import StepClock, finish
from _grpo_work import PAD_ID, TARGETS, parity_reward


def reward(prompts, completions, rows) -> list[float]:
    """The bench's reward as a tunelab reward component (``prompts, completions, rows``)."""
    return parity_reward(completions)


def run(args: argparse.Namespace) -> None:
    """Train ``1 + steps`` steps of ``args.shape_file``'s prompts; rank 0 writes the result."""
    from tokenizers import Tokenizer

    import tunelab.peft as peft
    from _system import peak_rss_bytes, reset_peak_rss
    from tunelab.config.lora import LoRAArgs
    from tunelab.config.sections import LoRAModelSetupArgs, RolloutArgs
    from tunelab.distributed import init_distributed
    from tunelab.rl import (
        GroupSampler,
        GRPOLoss,
        ModelRolloutEngine,
        Rewards,
        global_sums,
        policy_gradient_pass,
        step_counts,
    )
    from tunelab.training import OptimizerStep, adamw, build_model, output_layer

    info = init_distributed("cpu")
    world, rank = info.world_size, info.rank
    shape = json.loads(Path(args.shape_file).read_text())
    lora = LoRAArgs(rank=8, alpha=16.0, dropout=0.0, targets=TARGETS)
    device = torch.device("cpu")
    model = build_model(LoRAModelSetupArgs(path=shape["model"]), device=device, lora=lora)
    trainable = list(peft.get_adapter_params(model).values())
    optimizer = adamw(trainable, lr=1e-4, weight_decay=0.0)
    optimizer_step = OptimizerStep(optimizer, trainable, clip_grad_norm=1.0)
    # The recipe's rollout defaults (engine, merge, gather, sampling at temperature 1); the stop
    # tokens unreachable: every completion is max_new_tokens long, as TRL's (see _grpo_work).
    rollout = RolloutArgs(num_generations=args.num_generations, max_new_tokens=args.max_new_tokens)
    tokenizer = Tokenizer.from_file(str(Path(shape["model"]) / "tokenizer.json"))
    words = SimpleNamespace(stop_ids=[], pad_id=PAD_ID, decode=tokenizer.decode)
    engine = ModelRolloutEngine.from_rollout(model, rollout, words)
    clock = StepClock()
    generate = engine.generate

    def timed_generate(prompts, seeds):
        start = time.perf_counter()
        completions = generate(prompts, seeds)
        clock.add("generate_s", time.perf_counter() - start)
        clock.add("generated_tokens", sum(len(c) for c in completions))
        return completions

    engine.generate = timed_generate
    prompts = shape["prompts"]
    data = SimpleNamespace(
        tokens=prompts,
        prompts=[tokenizer.decode(p) for p in prompts],
        rows=[{} for _ in prompts],
    )
    rewards = Rewards([{"_component_": "_grpo_tunelab.reward"}])
    groups = GroupSampler.from_settings(engine, rewards, data, rollout, seed=0, device=device)
    loss_fn = GRPOLoss(aggregation="token_mean")  # DAPO; beta 0
    output = output_layer(model)
    load_peak = peak_rss_bytes()
    reset_peak_rss()
    model.train()
    per_rank = args.prompts // world
    work = []
    for step in range(1 + args.steps):
        clock.start()
        first = step * args.prompts + rank * per_rank
        scored = [groups.sample(list(range(first, first + per_rank)), step)]
        clock.lap("rollout_s")
        part = scored[0].rollout
        labels = part.batch["labels"]
        completion = (labels != -100).sum(dim=1)
        prompt = (labels != -100).int().argmax(dim=1)  # the first completion position
        work.append(list(zip(prompt.tolist(), completion.tolist())))
        counts = step_counts(scored, device)
        divisor = loss_fn.normalizer(
            num_sequences=int(counts["num_sequences"]),
            num_tokens=int(counts["num_tokens"]),
            max_new_tokens=args.max_new_tokens,
        )
        sums = policy_gradient_pass(model, [part], loss_fn, output, scale=world / divisor)
        optimizer_step(loss=global_sums(sums, device)["loss"] / divisor, step=step + 1)
        clock.lap("update_s")
        clock.stop()
    finish(args.result, clock, work, load_peak, peak_rss_bytes())
