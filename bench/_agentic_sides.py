"""bench_agentic's two sides: tunelab's agentic GRPO step and TRL's ``GRPOTrainer(tools=...)``.

Each side runs in a process of its own (one process, ``OMP_NUM_THREADS`` threads): 1 warm-up
step, then the timed steps. Both roll out the same prompts in the same order (TRL:
``shuffle_dataset: false``) with greedy decoding (tunelab: temperature 0; TRL:
``do_sample: false``), G episodes per prompt, the same tool (:func:`calculator`), turns and
lengths, LoRA r=8 on every projection, DAPO's token-mean loss, beta 0, one iteration. What each
side did is recorded per step (every episode's token ids after its prompt) so the orchestrator
can check that both did the same work before it prints a ratio.

Per step: wall and CPU seconds of the step and of the rollout's generation (tunelab: the episode
runner's turns; TRL: its ``generate`` calls), generated tokens (the policy's tokens)
and prefilled tokens (tunelab: what the KV cache prefilled, prompts and tool deltas; TRL: every
``generate`` call's whole input, the conversation again at each turn).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from _grpo_work import TARGETS
from tunelab.rl.agentic import calculator as tunelab_calculator

END_OF_TURN = "<|im_end|>"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2".
    """
    # An error is text on both sides (TRL writes an exception as {'error': ...}, tunelab as
    # "Error: ... raised ..."): the same tool result, so the same conversation.
    try:
        return tunelab_calculator(expression)
    except ValueError as error:
        return f"error: {error}"


def reward(prompts, completions, rows=None, **_) -> list[float]:
    """Both sides' reward: the episode's final answer's length parity (cheap, deterministic)."""
    return [float(len(str(c)) % 2) for c in completions]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Clock:
    """Per-step wall and CPU seconds, generation time and token counts."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._wall = self._cpu = 0.0

    def start(self) -> None:
        self.steps.append(
            dict.fromkeys(
                ("step_s", "step_cpu_s", "generate_s", "generate_cpu_s", "generated", "prefilled"),
                0.0,
            )
        )
        self._wall, self._cpu = time.perf_counter(), _cpu_seconds()

    def add(self, key: str, value: float) -> None:
        if self.steps:
            self.steps[-1][key] += value

    def stop(self) -> None:
        self.add("step_s", time.perf_counter() - self._wall)
        self.add("step_cpu_s", _cpu_seconds() - self._cpu)


def _write(result: str, clock: Clock, work: list[list[list[int]]], tool_calls: int) -> None:
    record = {"steps": clock.steps, "work": work, "tool_calls": tool_calls}
    Path(result).write_text(json.dumps(record))
    sys.stdout.flush()
    os._exit(0)  # no gloo or trainer teardown to wait for


def run_tunelab(setup: dict[str, Any], result: str) -> None:
    """The recipe's agentic pieces, in its order: episodes, advantages, the loss, the step."""
    import tunelab.peft as peft
    from tunelab.config.agentic_section import AgenticArgs
    from tunelab.config.lora import LoRAArgs
    from tunelab.config.sections import LoRAModelSetupArgs, RolloutArgs
    from tunelab.data import load_tokenizer
    from tunelab.rl import (
        GRPOLoss,
        ModelRolloutEngine,
        Rewards,
        global_sums,
        policy_gradient_pass,
        step_counts,
    )
    from tunelab.rl.agentic import EpisodeGroupSampler, EpisodeRunner
    from tunelab.training import OptimizerStep, adamw, build_model, output_layer

    device = torch.device("cpu")
    clock = Clock()
    model_dir = setup["model"]
    tokenizer = load_tokenizer(model_dir, max_seq_len=512, chat_template=setup["chat_template"])
    lora = LoRAArgs(rank=8, alpha=16.0, dropout=0.0, targets=TARGETS)
    model = build_model(LoRAModelSetupArgs(path=model_dir), device=device, lora=lora)
    trainable = list(peft.get_adapter_params(model).values())
    optimizer = adamw(trainable, lr=1e-4, weight_decay=0.0)
    optimizer_step = OptimizerStep(optimizer, trainable, clip_grad_norm=1.0)
    rollout = RolloutArgs(
        num_generations=setup["num_generations"],
        max_new_tokens=setup["max_episode_tokens"],  # per reply: the episode's budget bounds it
        temperature=0.0,  # greedy: the same tokens as TRL's greedy generate
    )
    engine = ModelRolloutEngine.from_rollout(model, rollout, tokenizer)
    agentic = AgenticArgs(
        tools=[{"_component_": "_agentic_sides.calculator"}],
        max_turns=setup["max_turns"],
        max_tool_calls=setup["max_turns"],
        max_episode_tokens=setup["max_episode_tokens"],
        tool_format="hermes",
    )
    runner = EpisodeRunner.from_settings(engine, tokenizer, agentic)
    turn = runner.sampler.turn

    def timed_turn(*turn_args, **turn_kwargs):
        start = _cpu_seconds()
        replies = turn(*turn_args, **turn_kwargs)
        clock.add("generate_cpu_s", _cpu_seconds() - start)
        return replies

    runner.sampler.turn = timed_turn
    prompts = setup["prompts"]
    data = SimpleNamespace(rows=[{"prompt": p} for p in prompts], prompts=prompts, tokens=None)
    rewards = Rewards([{"_component_": "_agentic_sides.reward"}])
    groups = EpisodeGroupSampler.from_runner(runner, rewards, data, rollout, seed=0, device=device)
    loss_fn = GRPOLoss(aggregation="token_mean")
    output = output_layer(model)
    work, tool_calls = [], 0
    per_step = setup["prompts_per_step"]
    model.train()
    for step in range(1 + setup["steps"]):
        clock.start()
        scored = groups.sample(list(range(step * per_step, (step + 1) * per_step)), step)
        timings = runner.last_metrics
        clock.add("generate_s", timings["generation_seconds"])
        clock.add("generated", timings["generated_tokens"])
        clock.add("prefilled", timings["prefill_tokens"])
        work.append(sorted(r["completion_ids"] for r in scored.records))
        tool_calls += sum(r["num_tool_calls"] for r in scored.records)
        counts = step_counts([scored], device)
        divisor = loss_fn.normalizer(
            num_sequences=int(counts["num_sequences"]),
            num_tokens=int(counts["num_tokens"]),
            max_new_tokens=setup["max_episode_tokens"],
        )
        sums = policy_gradient_pass(model, [scored.rollout], loss_fn, output, scale=1 / divisor)
        optimizer_step(loss=global_sums(sums, device)["loss"] / divisor, step=step + 1)
        clock.stop()
    _write(result, clock, work, tool_calls)


def run_trl(setup: dict[str, Any], result: str) -> None:
    """``trl.GRPOTrainer`` with ``tools=[calculator]`` on the same model, prompts and lengths."""
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.chat_template_utils import qwen3_template

    from _grpo_trl import LORA, SHARED_SETTINGS

    model = AutoModelForCausalLM.from_pretrained(
        setup["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    tokenizer.chat_template = Path(setup["chat_template"]).read_text()
    # TRL cuts a turn at the tokenizer's EOS to append the tool turn: the template's end of turn.
    tokenizer.eos_token = END_OF_TURN
    # The template writes calls as Qwen 2.5 / Qwen3 do (<tool_call>{json}</tool_call>, turns in
    # <|im_start|>...<|im_end|>): TRL's own Qwen3 response parser reads them.
    tokenizer.response_template = qwen3_template
    per_step = setup["prompts_per_step"]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p}]} for p in setup["prompts"]]
    )
    clock, work, calls = Clock(), [], [0]

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            clock.start()

        def on_step_end(self, *_, **__):
            clock.stop()

    config = trl.GRPOConfig(
        output_dir=str(Path(result).with_suffix("")),
        per_device_train_batch_size=per_step * setup["num_generations"],
        num_generations=setup["num_generations"],
        max_completion_length=setup["max_episode_tokens"],
        max_tool_calling_iterations=setup["max_turns"] - 1,
        generation_kwargs={"do_sample": False},
        shuffle_dataset=False,
        max_steps=1 + setup["steps"],
        **SHARED_SETTINGS,
    )
    lora = LoraConfig(**LORA)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        tools=[calculator],
        callbacks=[StepTimes()],
    )
    stop_ids = set(trainer.eos_token_ids)
    generate = trainer.model.generate

    def timed_generate(*gen_args, **gen_kwargs):
        start, cpu = time.perf_counter(), _cpu_seconds()
        out = generate(*gen_args, **gen_kwargs)
        clock.add("generate_s", time.perf_counter() - start)
        clock.add("generate_cpu_s", _cpu_seconds() - cpu)
        prompt_ids = gen_kwargs.get("input_ids", gen_args[0] if gen_args else None)
        attention = gen_kwargs.get("attention_mask", torch.ones_like(prompt_ids))
        clock.add("prefilled", float(attention.sum()))
        for new in out[:, prompt_ids.shape[1] :].tolist():
            ends = [i for i, token in enumerate(new) if token in stop_ids]
            clock.add("generated", float(ends[0] + 1 if ends else len(new)))
        return out

    trainer.model.generate = timed_generate
    rollout = trainer._generate_and_score_completions

    def recorded_rollout(*args, **kwargs):
        batch = rollout(*args, **kwargs)
        ids, mask = batch["completion_ids"], batch["completion_mask"]
        work.append(sorted(row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)))
        return batch

    trainer._generate_and_score_completions = recorded_rollout
    tool_loop = trainer._tool_call_loop

    def counted_tool_loop(*args, **kwargs):
        out = tool_loop(*args, **kwargs)
        calls[0] += out[4]
        return out

    trainer._tool_call_loop = counted_tool_loop
    trainer.train()
    _write(result, clock, work, calls[0])


if __name__ == "__main__":
    side, setup_file, result_file = sys.argv[1:4]
    setup = json.loads(Path(setup_file).read_text())
    {"tunelab": run_tunelab, "trl": run_trl}[side](setup, result_file)
