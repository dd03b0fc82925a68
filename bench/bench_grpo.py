"""GRPO: tunelab's grpo_distributed step against TRL's GRPOTrainer, side by side (issue 26).

Run (one process; ``make bench`` installs trl with the ``bench`` extra):

    python bench/bench_grpo.py
    python bench/bench_grpo.py --steps 2 --max-new-tokens 8 --logps-vocab-size 4096 --smoke

Two measurements, each tunelab's path and TRL's on the same inputs, one after the other:

- **Step time and generation tokens/s** on the embedded tiny Llama-style model (its own
  tokenizer), the first ``--prompts`` prompts of ``tiny/grpo``, ``--num-generations``
  completions each, up to ``--max-new-tokens`` tokens, temperature 1, LoRA r=8 on every
  projection, fp32, ``beta`` 0, one optimizer step per batch of rollouts. tunelab: the pieces
  the recipe calls in its order (``GroupSampler.sample`` with the built-in engine,
  ``policy_gradient_pass``, ``optimizer_step``). TRL: ``trl.GRPOTrainer`` with its own
  generation (``transformers`` ``generate``), the same settings, timed by a callback from
  ``on_step_begin`` to ``on_step_end``; its generation time is that of the model's
  ``generate`` calls. Both stop a completion at EOS, so lengths differ a little: tokens/s is
  the figure; step time is per step (median after a warm-up step).
- **Peak memory of the log-prob pass** (forward and backward of the completion log-probs,
  what each runs per micro-batch) of a synthetic 2-layer model with a ``--logps-vocab-size``
  vocabulary (default 128256, Llama 3's) and one row of ``--logps-completion-tokens``
  completion tokens (default 1024) after a 64-token prompt, LoRA as above. tunelab: the
  chunked output layer at completion positions only (``completion_logps``); TRL: the
  model's logits for the completion (``logits_to_keep``) and ``selective_log_softmax``, as
  ``GRPOTrainer`` computes them. Peak resident-set growth over the pass (``_system.PeakRSS``).

Targets (the issue's): tunelab's step and generation at least 1.5x TRL's; the log-prob pass's
peak memory at most 0.5x TRL's. Without trl the TRL columns say "not measured".
"""

import argparse
import importlib.util
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import Row, mebibytes, print_table, seconds
from _models import llama_config, write_hf_checkpoint
from _system import PeakRSS

TINY = Path(__file__).resolve().parents[1] / "framework" / "tunelab" / "assets" / "tiny"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NOT_MEASURED = "not measured"


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--logps-vocab-size", type=int, default=128256)
    parser.add_argument("--logps-completion-tokens", type=int, default=1024)
    parser.add_argument("--logps-dim", type=int, default=256)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="tunelab/TRL pairs, the order alternating (on a loaded machine): the step and "
        "generation rows give the median of the pairs' ratios",
    )
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the script runs")
    return parser.parse_args()


def trl_installed() -> bool:
    """Whether the TRL side can run here."""
    return importlib.util.find_spec("trl") is not None


def lora_args():
    from tunelab.config.lora import LoRAArgs

    return LoRAArgs(rank=8, alpha=16.0, dropout=0.0, targets=TARGETS)


def peft_lora():
    from peft import LoraConfig

    return LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )


# -- step time and generation ------------------------------------------------------------


def tunelab_steps(args: argparse.Namespace) -> dict[str, float]:
    """The recipe's step, in-process: median step seconds and generation tokens/s."""
    import tunelab.peft as peft
    from tunelab.data import load_tokenizer, prompt_dataset
    from tunelab.losses import GRPOLoss, loss_normalizer
    from tunelab.training import (
        GroupSampler,
        ModelRolloutEngine,
        Rewards,
        SamplingSettings,
        adamw,
        build_model,
        optimizer_step,
        output_layer,
        policy_gradient_pass,
        step_counts,
    )

    torch.manual_seed(0)
    tokenizer = load_tokenizer(str(TINY), max_seq_len=256)
    data = prompt_dataset(
        tokenizer, source="json", data_files=str(TINY / "grpo_prompts.jsonl"), template="instruct"
    )
    model = build_model(
        str(TINY), device=torch.device("cpu"), dtype=torch.float32, lora=lora_args()
    )
    trainable = list(peft.get_adapter_params(model).values())
    optimizer = adamw(trainable, lr=1e-4, weight_decay=0.0)
    settings = SamplingSettings(
        max_new_tokens=args.max_new_tokens, temperature=1.0, stop_ids=frozenset(tokenizer.stop_ids)
    )
    engine = ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id)
    pattern = {"_component_": "tunelab.training.regex_reward", "pattern": "[0-9 ]+"}
    groups = GroupSampler(
        engine,
        Rewards([pattern]),
        data,
        decode=tokenizer.decode,
        pad_id=tokenizer.pad_id,
        num_generations=args.num_generations,
        seed=0,
        scale_rewards=True,
        dynamic_sampling=False,
        device=torch.device("cpu"),
    )
    loss_fn = GRPOLoss(aggregation="sequence_mean")
    output = output_layer(model)
    step_times, generated, generation_seconds = [], 0, 0.0
    for step in range(1 + args.steps):
        start = time.perf_counter()
        scored = [groups.sample(list(range(args.prompts)), step)]
        counts = step_counts(scored, torch.device("cpu"))
        divisor = loss_normalizer(
            "sequence_mean",
            num_sequences=int(counts["num_sequences"]),
            num_tokens=int(counts["num_tokens"]),
            max_new_tokens=args.max_new_tokens,
        )
        policy_gradient_pass(model, [s.rollout for s in scored], loss_fn, output, scale=1 / divisor)
        optimizer_step(optimizer, trainable, clip_grad_norm=1.0, lr_scheduler=None)
        if step:  # the first step warms up
            step_times.append(time.perf_counter() - start)
            generated += engine.last_generated_tokens
            generation_seconds += engine.last_generation_seconds
    return {
        "step_seconds": statistics.median(step_times),
        "generation_tokens_per_second": generated / generation_seconds,
    }


def trl_steps(args: argparse.Namespace, scratch: Path) -> dict[str, float]:
    """TRL's GRPOTrainer on the same model, prompts and settings."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from tunelab.data import load_tokenizer, prompt_dataset

    ours = load_tokenizer(str(TINY), max_seq_len=256)
    data = prompt_dataset(
        ours, source="json", data_files=str(TINY / "grpo_prompts.jsonl"), template="instruct"
    )
    # The same rendered prompt texts (TRL tokenizes them with the HF tokenizer of the folder).
    dataset = Dataset.from_list([{"prompt": data.prompts[i]} for i in range(args.prompts)])
    model = AutoModelForCausalLM.from_pretrained(
        str(TINY), dtype=torch.float32, attn_implementation="sdpa"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(TINY))
    step_times: list[float] = []
    generation = {"seconds": 0.0, "tokens": 0, "on": False}

    class StepTimes(TrainerCallback):
        def on_step_begin(self, _args, state, *__, **___):
            # global_step counts finished steps: 0 during the warm-up step.
            generation["on"] = state.global_step >= 1
            self.start = time.perf_counter()

        def on_step_end(self, _args, state, *__, **___):
            if state.global_step > 1:  # the first step warms up
                step_times.append(time.perf_counter() - self.start)

    def regex_reward(completions, **_):
        import re

        return [1.0 if re.fullmatch("[0-9 ]+", c.strip()) else 0.0 for c in completions]

    config = trl.GRPOConfig(
        output_dir=str(scratch / "trl"),
        per_device_train_batch_size=args.prompts * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        beta=0.0,
        num_iterations=1,
        learning_rate=1e-4,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        max_steps=1 + args.steps,
        gradient_checkpointing=False,
        bf16=False,  # every row here is fp32
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[regex_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_lora(),
        callbacks=[StepTimes()],
    )
    generate = trainer.model.generate

    def timed_generate(*gen_args, **gen_kwargs):
        start = time.perf_counter()
        out = generate(*gen_args, **gen_kwargs)
        prompt_ids = gen_kwargs.get("input_ids", gen_args[0] if gen_args else None)
        if generation["on"] and prompt_ids is not None:
            generation["seconds"] += time.perf_counter() - start
            new = out[:, prompt_ids.shape[1] :]
            generation["tokens"] += int((new != tokenizer.pad_token_id).sum())
        return out

    trainer.model.generate = timed_generate
    trainer.train()
    return {
        "step_seconds": statistics.median(step_times),
        # None when TRL generated through another path than the model's generate.
        "generation_tokens_per_second": (
            generation["tokens"] / generation["seconds"] if generation["tokens"] else None
        ),
    }


# -- peak memory of the log-prob pass ------------------------------------------------------


def logps_batch(args: argparse.Namespace) -> tuple[torch.Tensor, int]:
    """One row: a 64-token prompt and ``--logps-completion-tokens`` completion tokens."""
    generator = torch.Generator().manual_seed(0)
    length = 64 + args.logps_completion_tokens
    return torch.randint(3, args.logps_vocab_size, (1, length), generator=generator), 64


def tunelab_logps_peak(args: argparse.Namespace, base: Path) -> float:
    """Peak RSS growth of tunelab's chunked completion log-prob forward + backward."""
    from tunelab.training import build_model, completion_logps, output_layer, rollout_batch

    model = build_model(
        str(base), device=torch.device("cpu"), dtype=torch.float32, lora=lora_args()
    )
    tokens, prompt = logps_batch(args)
    row = tokens[0].tolist()
    batch = rollout_batch([row[:prompt]], [row[prompt:]], 0, torch.device("cpu"))
    with PeakRSS() as memory:
        logps, mask = completion_logps(model, batch, output_layer(model))
        logps[mask].sum().backward()
    return memory.peak_growth


def trl_logps_peak(args: argparse.Namespace, base: Path) -> float:
    """Peak RSS growth of GRPOTrainer's way: the completion's logits, selective_log_softmax."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import selective_log_softmax

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), peft_lora()
    )
    tokens, prompt = logps_batch(args)
    completion = tokens[:, prompt:]
    with PeakRSS() as memory:
        logits = model(input_ids=tokens, logits_to_keep=completion.shape[1] + 1).logits
        logps = selective_log_softmax(logits[:, :-1], completion)
        logps.sum().backward()
    return memory.peak_growth


def _median_or_none(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _load_average() -> list[str]:
    """The 1, 5 and 15 minute load averages (other work on the machine), or nothing."""
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return []


def main() -> None:
    args = parse_args()
    if args.smoke:
        args.steps, args.max_new_tokens = min(args.steps, 1), min(args.max_new_tokens, 8)
        args.logps_vocab_size = min(args.logps_vocab_size, 4096)
        args.logps_completion_tokens = min(args.logps_completion_tokens, 64)
    scratch = Path(args.dir or tempfile.gettempdir()) / "bench_grpo"
    shutil.rmtree(scratch, ignore_errors=True)
    base = scratch / "base"
    write_hf_checkpoint(
        base, llama_config(dim=args.logps_dim, num_layers=2, vocab_size=args.logps_vocab_size)
    )
    peer = trl_installed()
    pairs = []  # (ours, theirs) per repeat, the order alternating so that load drifts cancel
    for repeat in range(args.repeats):
        if peer and repeat % 2:
            theirs = trl_steps(args, scratch)
            pairs.append((tunelab_steps(args), theirs))
        else:
            pairs.append((tunelab_steps(args), trl_steps(args, scratch) if peer else None))
    ours = {key: statistics.median(p[0][key] for p in pairs) for key in pairs[0][0]}
    theirs = None
    if peer:
        theirs = {key: _median_or_none([p[1][key] for p in pairs]) for key in pairs[0][1]}
    our_peak = tunelab_logps_peak(args, base)
    their_peak = trl_logps_peak(args, base) if peer else None
    shutil.rmtree(scratch, ignore_errors=True)

    def pair_ratio(key, higher_is_better):
        # The median of the pairs' ratios: each pair ran minutes apart at most, in one load.
        ratios = [
            (our[key] / their[key] if higher_is_better else their[key] / our[key])
            for our, their in pairs
            if their is not None and their[key] is not None
        ]
        return statistics.median(ratios) if ratios else None

    def row(figure, our, their, fmt, higher_is_better, target, bound, key=None):
        if their is None:
            return Row(figure, fmt(our), NOT_MEASURED, "-", target, None)
        ratio = our / their if higher_is_better else their / our
        if key is not None and pair_ratio(key, higher_is_better) is not None:
            ratio = pair_ratio(key, higher_is_better)
        if bound < 1:  # memory: ours over theirs, at most the bound
            ratio = our / their
            return Row(figure, fmt(our), fmt(their), f"{ratio:.2f}x", target, ratio <= bound)
        return Row(figure, fmt(our), fmt(their), f"{ratio:.2f}x", target, ratio >= bound)

    rows = [
        row("step time (TRL / tunelab)", ours["step_seconds"],
            theirs and theirs["step_seconds"], seconds, False, ">= 1.5x", 1.5,
            key="step_seconds"),
        row("generation tokens/s (tunelab / TRL)", ours["generation_tokens_per_second"],
            theirs and theirs["generation_tokens_per_second"], lambda v: f"{v:.0f}", True,
            ">= 1.5x", 1.5, key="generation_tokens_per_second"),
        row(f"log-prob pass peak memory, vocab {args.logps_vocab_size}, "
            f"{args.logps_completion_tokens} completion tokens (tunelab / TRL)",
            our_peak, their_peak, mebibytes, False, "<= 0.5x", 0.5),
    ]  # fmt: skip
    print_table(
        "GRPO: tunelab vs TRL GRPOTrainer (1 process, fp32, LoRA r=8)",
        rows,
        notes=[
            f"{args.prompts} prompts x {args.num_generations} completions, up to "
            f"{args.max_new_tokens} new tokens, median of {args.steps} steps after a warm-up; "
            + ("TRL " + __import__("trl").__version__ if peer else "trl not installed: TRL "
               "columns not measured (make bench installs it)"),
            *([f"{args.repeats} tunelab/TRL pairs, order alternating; figures are medians, "
               "ratios the median of the pairs' ratios; per pair (step, generation): "
               + ", ".join(
                   f"{t['step_seconds'] / o['step_seconds']:.2f}x/"
                   f"{o['generation_tokens_per_second'] / t['generation_tokens_per_second']:.2f}x"
                   for o, t in pairs if t is not None and t["generation_tokens_per_second"])
               + f"; load average {' '.join(_load_average())}"]
              if args.repeats > 1 else []),
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
