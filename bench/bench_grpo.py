"""GRPO: tunelab's grpo_distributed step against TRL's GRPOTrainer, side by side (issue 26).

Run (one process; ``make bench`` installs trl with the ``bench`` extra):

    python bench/bench_grpo.py
    python bench/bench_grpo.py --smoke    # its smallest sizes: checks it runs

Two measurements, each tunelab's path and TRL's on the same inputs, one after the other:

- **Step time and generation tokens/s** on the embedded tiny Llama-style model (its own
  tokenizer), the first ``--prompts`` prompts of ``tiny/grpo``, ``--num-generations``
  completions each, up to ``--max-new-tokens`` tokens, greedy, LoRA r=8 on every projection,
  fp32, ``beta`` 0, one optimizer step per batch of rollouts. tunelab: the pieces the recipe
  calls in its order (``GroupSampler.sample`` with the built-in engine,
  ``policy_gradient_pass``, ``OptimizerStep``). TRL: ``trl.GRPOTrainer`` with its own
  generation (``transformers`` ``generate``, ``do_sample=False``), the same settings, timed by
  a callback from ``on_step_begin`` to ``on_step_end``; its generation time is that of the
  model's ``generate`` calls. Step time is per step (median after a warm-up step).

  A ratio is only meaningful if both sides did the same work, so decoding is greedy on both
  (two samplers never draw the same tokens from the same seed) and, before any step or
  generation ratio is printed, every step's prompts and completions are compared token for
  token (``work_difference``): where they differ the table says so and gives no ratio. With
  greedy decoding the G completions of a prompt are equal, so the advantages are 0 and the
  weights stay put: each step still runs every forward, backward and optimizer update at
  full cost, and the same completions come back every step on both sides.
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
from collections.abc import Collection, Sequence
from pathlib import Path

import torch

from _common import Row, mebibytes, parse_bench_args, print_table, seconds
from _models import llama_config, write_hf_checkpoint
from _system import PeakRSS

TINY = Path(__file__).resolve().parents[1] / "framework" / "tunelab" / "assets" / "tiny"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NOT_MEASURED = "not measured"
NOT_COMPARABLE = "none: not the same work"


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
    smoke = ["--steps", "1", "--prompts", "2", "--num-generations", "2", "--max-new-tokens", "6",
             "--logps-vocab-size", "1024", "--logps-completion-tokens", "16", "--logps-dim", "64"]  # fmt: skip
    return parse_bench_args(parser, smoke)


Completions = list[list[tuple[tuple[int, ...], tuple[int, ...]]]]
"""What one side generated: per step, the sorted ``(prompt ids, completion ids)`` of each row."""


def ended(ids: Sequence[int], stop_ids: Collection[int]) -> tuple[int, ...]:
    """``ids`` up to and including the first stop token: the completion either side trains on.

    (``generate`` pads a finished row after its EOS; tunelab's engine keeps the stop token.)
    """
    ids = [int(i) for i in ids]
    for position, token in enumerate(ids):
        if token in stop_ids:
            return tuple(ids[: position + 1])
    return tuple(ids)


def work_difference(ours: Completions, theirs: Completions) -> str | None:
    """How the work two sides generated differs, in words; None when it is the same.

    The same work: as many steps, and in each the same prompts with the same completions,
    token for token, hence the same number of completion tokens.

    Args:
        ours: tunelab's completions, per step.
        theirs: The other side's, per step.

    Returns:
        The first difference found, or None.
    """
    if len(ours) != len(theirs):
        return f"tunelab ran {len(ours)} steps, TRL {len(theirs)}"
    for step, (our_rows, their_rows) in enumerate(zip(ours, theirs)):
        if sorted(p for p, _ in our_rows) != sorted(p for p, _ in their_rows):
            return (
                f"step {step}: the prompts differ ({len(our_rows)} rows against {len(their_rows)})"
            )
        our_tokens = sum(len(c) for _, c in our_rows)
        their_tokens = sum(len(c) for _, c in their_rows)
        if our_tokens != their_tokens:
            return f"step {step}: {our_tokens} completion tokens against {their_tokens}"
        for row, (our, their) in enumerate(zip(sorted(our_rows), sorted(their_rows))):
            if our != their:
                at = next(
                    (i for i, (a, b) in enumerate(zip(our[1], their[1])) if a != b),
                    min(len(our[1]), len(their[1])),
                )
                return f"step {step}: completion {row} differs from token {at} on"
    return None


def trl_installed() -> bool:
    """Whether the TRL side can run here."""
    return importlib.util.find_spec("trl") is not None


def peer_name() -> str:
    """The peer and its version, for the notes."""
    import trl

    return f"TRL {trl.__version__}"


def lora_args():
    from tunelab.config.lora import LoRAArgs

    return LoRAArgs(rank=8, alpha=16.0, dropout=0.0, targets=TARGETS)


def peft_lora():
    from peft import LoraConfig

    return LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )


# -- step time and generation ------------------------------------------------------------


def tunelab_steps(args: argparse.Namespace) -> tuple[dict[str, float], Completions]:
    """The recipe's step, in-process: median step seconds and generation tokens/s.

    Returns:
        The figures, and the prompts and completions of every step (the warm-up's too).
    """
    import tunelab.peft as peft
    from tunelab.data import load_tokenizer, prompt_dataset
    from tunelab.rl import (
        GroupSampler,
        GRPOLoss,
        ModelRolloutEngine,
        Rewards,
        SamplingSettings,
        loss_normalizer,
        policy_gradient_pass,
        step_counts,
    )
    from tunelab.training import OptimizerStep, adamw, load_model, output_layer

    torch.manual_seed(0)
    tokenizer = load_tokenizer(str(TINY), max_seq_len=256)
    data = prompt_dataset(
        tokenizer, source="json", data_files=str(TINY / "grpo_prompts.jsonl"), template="instruct"
    )
    model = load_model(str(TINY), device=torch.device("cpu"), dtype=torch.float32, lora=lora_args())
    trainable = list(peft.get_adapter_params(model).values())
    optimizer = adamw(trainable, lr=1e-4, weight_decay=0.0)
    settings = SamplingSettings(
        max_new_tokens=args.max_new_tokens, temperature=0.0, stop_ids=frozenset(tokenizer.stop_ids)
    )
    engine = ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id)
    pattern = {"_component_": "tunelab.rl.regex_reward", "pattern": "[0-9 ]+"}
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
    completions: Completions = []
    for step in range(1 + args.steps):
        start = time.perf_counter()
        scored = [groups.sample(list(range(args.prompts)), step)]
        completions.append(sorted(rollout_rows(scored[0].rollout.batch)))
        counts = step_counts(scored, torch.device("cpu"))
        divisor = loss_normalizer(
            "sequence_mean",
            num_sequences=int(counts["num_sequences"]),
            num_tokens=int(counts["num_tokens"]),
            max_new_tokens=args.max_new_tokens,
        )
        policy_gradient_pass(model, [s.rollout for s in scored], loss_fn, output, scale=1 / divisor)
        OptimizerStep(optimizer, trainable, clip_grad_norm=1.0)()
        if step:  # the first step warms up
            step_times.append(time.perf_counter() - start)
            generated += engine.last_generated_tokens
            generation_seconds += engine.last_generation_seconds
    figures = {
        "step_seconds": statistics.median(step_times),
        "generation_tokens_per_second": generated / generation_seconds,
    }
    return figures, completions


def rollout_rows(batch: dict[str, torch.Tensor]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(prompt ids, completion ids)`` of each row of a ``rollout_batch``."""
    rows = []
    for tokens, labels in zip(batch["tokens"].tolist(), batch["labels"].tolist()):
        start = next(i for i, label in enumerate(labels) if label != -100)
        rows.append((tuple(tokens[:start]), tuple(label for label in labels if label != -100)))
    return rows


def trl_steps(args: argparse.Namespace, scratch: Path) -> tuple[dict[str, float], Completions]:
    """TRL's GRPOTrainer on the same model, prompts and settings.

    Returns:
        The figures, and the prompts and completions of every step (the warm-up's too).
    """
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from tunelab.data import load_tokenizer, prompt_dataset

    ours = load_tokenizer(str(TINY), max_seq_len=256)
    data = prompt_dataset(
        ours, source="json", data_files=str(TINY / "grpo_prompts.jsonl"), template="instruct"
    )
    # The same rendered prompt texts. TRL tokenizes them with the folder's HF tokenizer, which
    # adds BOS itself: a text that starts with it would begin with two (work_difference found
    # that), so the rendered BOS goes.
    tokenizer = AutoTokenizer.from_pretrained(str(TINY))
    adds_bos = tokenizer("").input_ids[:1] == [tokenizer.bos_token_id]
    bos = tokenizer.bos_token if adds_bos else None
    texts = [data.prompts[i] for i in range(args.prompts)]
    texts = [t[len(bos) :] if bos and t.startswith(bos) else t for t in texts]
    dataset = Dataset.from_list([{"prompt": text} for text in texts])
    model = AutoModelForCausalLM.from_pretrained(
        str(TINY), dtype=torch.float32, attn_implementation="sdpa"
    )
    step_times: list[float] = []
    generation = {"seconds": 0.0, "tokens": 0, "on": False}
    completions: Completions = []
    stop_ids = frozenset(ours.stop_ids)

    class StepTimes(TrainerCallback):
        def on_step_begin(self, _args, state, *__, **___):
            # global_step counts finished steps: 0 during the warm-up step.
            generation["on"] = state.global_step >= 1
            completions.append([])
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
        temperature=1.0,  # the log-probs unscaled, as tunelab's; decoding is greedy:
        generation_kwargs={"do_sample": False},
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
        if prompt_ids is not None:
            new = out[:, prompt_ids.shape[1] :]
            attention = gen_kwargs.get("attention_mask", torch.ones_like(prompt_ids))
            rows = [
                (tuple(p[a.bool()].tolist()), ended(n.tolist(), stop_ids))
                for p, a, n in zip(prompt_ids, attention, new)
            ]
            completions[-1].extend(rows)
            if generation["on"]:
                generation["seconds"] += time.perf_counter() - start
                generation["tokens"] += sum(len(c) for _, c in rows)
        return out

    trainer.model.generate = timed_generate
    trainer.train()
    figures = {
        "step_seconds": statistics.median(step_times),
        # None when TRL generated through another path than the model's generate.
        "generation_tokens_per_second": (
            generation["tokens"] / generation["seconds"] if generation["tokens"] else None
        ),
    }
    return figures, [sorted(rows) for rows in completions]


# -- peak memory of the log-prob pass ------------------------------------------------------


def logps_batch(args: argparse.Namespace) -> tuple[torch.Tensor, int]:
    """One row: a 64-token prompt and ``--logps-completion-tokens`` completion tokens."""
    generator = torch.Generator().manual_seed(0)
    length = 64 + args.logps_completion_tokens
    return torch.randint(3, args.logps_vocab_size, (1, length), generator=generator), 64


def tunelab_logps_peak(args: argparse.Namespace, base: Path) -> float:
    """Peak RSS growth of tunelab's chunked completion log-prob forward + backward."""
    from tunelab.rl import completion_logps, rollout_batch
    from tunelab.training import load_model, output_layer

    model = load_model(str(base), device=torch.device("cpu"), dtype=torch.float32, lora=lora_args())
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
    scratch = Path(args.dir or tempfile.gettempdir()) / "bench_grpo"
    shutil.rmtree(scratch, ignore_errors=True)
    base = scratch / "base"
    write_hf_checkpoint(
        base, llama_config(dim=args.logps_dim, num_layers=2, vocab_size=args.logps_vocab_size)
    )
    peer = trl_installed()
    pairs = []  # (ours, theirs) figures per repeat, the order alternating so load drifts cancel
    difference = None  # how the two sides' work differed, if it did
    for repeat in range(args.repeats):
        if peer and repeat % 2:
            theirs, their_work = trl_steps(args, scratch)
            ours, our_work = tunelab_steps(args)
        else:
            ours, our_work = tunelab_steps(args)
            theirs, their_work = trl_steps(args, scratch) if peer else (None, None)
        if their_work is not None:
            difference = difference or work_difference(our_work, their_work)
        pairs.append((ours, theirs))
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
        if key is not None and difference is not None:  # not the same work: no ratio
            return Row(figure, fmt(our), fmt(their), NOT_COMPARABLE, target, None)
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
            f"{args.max_new_tokens} new tokens, greedy, median of {args.steps} steps after a "
            "warm-up; "
            + (peer_name() if peer else "trl not installed: TRL columns not measured (make "
               "bench installs it)"),
            *([f"no step or generation ratio: TRL and tunelab did not do the same work "
               f"({difference})"] if difference else []),
            *(["both sides generated the same completions, token for token, in every step"]
              if peer and difference is None else []),
            *([f"{args.repeats} tunelab/TRL pairs, order alternating; figures are medians, "
               "ratios the median of the pairs' ratios; per pair (step, generation): "
               + ", ".join(
                   f"{t['step_seconds'] / o['step_seconds']:.2f}x/"
                   f"{o['generation_tokens_per_second'] / t['generation_tokens_per_second']:.2f}x"
                   for o, t in pairs if t is not None and t["generation_tokens_per_second"])
               + f"; load average {' '.join(_load_average())}"]
              if args.repeats > 1 and difference is None else []),
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
