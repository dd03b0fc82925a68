"""Distillation: tunelab's distill_distributed against TRL's GKDTrainer, side by side (issue 43).

Run (``make bench`` installs trl with the ``bench`` extra):

    python bench/bench_distill.py              # the loss, training at hidden 768, memory at 128k
    python bench/bench_distill.py --smoke      # its smallest sizes: checks it runs

1. The loss alone, forward and backward, generalized JSD (beta 0.5): tunelab's
   ``GeneralizedJSDLoss`` on both models' hidden states, the output layers applied chunk by
   chunk, against TRL's ``GKDTrainer.generalized_jsd_loss`` on the two whole logits tensors
   (the output layers applied first, as ``GKDTrainer.compute_loss`` does). Vocabulary
   ``--vocab-size`` (128256), ``--loss-tokens`` scored positions, hidden size ``--dim``, fp32.
   Peak of live tensors (``_live_tensors``: every tensor torch allocates, counted op by op) and
   seconds. The issue's figure is 128k x 4096 tokens (``--loss-tokens 4096``).
2. Training at a realistic shape, offline (``lmbda`` 0) and on-policy (``lmbda`` 1): a
   random-init Llama-style student (``--student-dim`` 768 x ``--student-layers`` 4, GQA 12/4,
   MLP 2048: ``_grpo_work.wide_config``) and a 2x deeper teacher (768 x 8), vocabulary
   ``--train-vocab`` (32768), the tiny model's tokenizer and chat template (the rows above its
   810 tokens are padding no text produces), LoRA r=8 on every projection of the student,
   generalized JSD beta 0.5, temperature 1, batch ``--batch-size``, ``--max-new-tokens``
   sampled tokens on-policy. The data: ``--rows`` single-turn chats of exactly
   ``--words`` one-token words each way ("Reverse the words: ..."), so every row has the same
   length and both trainers score the same tokens in every step (checked: the scored tokens
   of every timed step are compared, and the row says so where they differ). Each side runs
   in its own fresh process, ``--rounds`` rounds alternating which goes first (ABBA); tunelab
   is the real ``distill_distributed`` recipe under torchrun (1 process), TRL ``GKDTrainer``
   with the same folders, data, LoRA and lengths. Tokens/s: scored tokens over the wall time
   of the timed steps (each step from its start to the end of its optimizer step; the first
   step untimed), per round; tokens per CPU-second beside it (the process's CPU time over the
   same steps), which load distorts less. The ratio is the median of the rounds' ratios.
3. Peak memory of the training itself: the growth of the process's resident set over the
   training, ``VmHWM`` after the last step's update minus ``VmRSS`` when training starts
   (after imports, both models, the optimizer and the data; glibc's free memory returned
   first, ``VmHWM`` reset by writing 5 to ``/proc/self/clear_refs``): what the models' weights
   and the libraries take is the same on both sides and not the claim. tunelab's end-of-run
   export and save come after the measured point (TRL saves nothing). Measured in the training
   runs of part 2 (the largest round) and again at vocabulary ``--memory-vocab`` (128256),
   batch ``--memory-batch-size``, ``--memory-steps`` steps, where the logits dominate.

Targets (issue 43): tokens/s at least 1.3x TRL's, peak memory at most 0.5x; the loss's peak at
most 0.3x of materialising both logits.
"""

import argparse
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    LORA_TARGETS,
    Row,
    launch_env,
    mebibytes,
    parse_bench_args,
    print_table,
    seconds,
    tiny_dir,
    torchrun,
)
from _live_tensors import LiveTensorBytes

HERE = Path(__file__).resolve().parent
RECIPE = HERE.parent / "recipes" / "distill_distributed.py"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Words the tiny tokenizer encodes as one token each after a space: a row of n of them is n
# tokens, so every row of the bench's data has the same length.
WORDS = (
    "apple", "bed", "bell", "bird", "black", "blue", "book", "box", "bread", "bus", "cake",
    "car", "cat", "cow", "cup", "dog", "door", "egg", "fish", "green", "hat", "hill", "key",
    "lamp", "leaf",
)  # fmt: skip


def parse_args() -> argparse.Namespace:
    """Command-line flags (the orchestrator's, and the workers')."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=128256, help="the loss part's")
    parser.add_argument("--loss-tokens", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256, help="the loss part's hidden size")
    parser.add_argument("--train-vocab", type=int, default=32768)
    parser.add_argument("--student-dim", type=int, default=768)
    parser.add_argument("--student-layers", type=int, default=4)
    parser.add_argument("--teacher-dim", type=int, default=768)
    parser.add_argument("--teacher-layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=96, help="rows of the chat data")
    parser.add_argument("--words", type=int, default=48, help="words per message")
    parser.add_argument("--steps", type=int, default=4, help="training steps (the first untimed)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--memory-vocab", type=int, default=128256)
    parser.add_argument("--memory-batch-size", type=int, default=4)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--parts", default="loss,training,memory", help="which parts to run")
    parser.add_argument("--modes", default="offline,on-policy", help="training modes to run")
    parser.add_argument("--dir", default=None, help="scratch folder (default: the temp dir)")
    parser.add_argument("--worker", choices=["tunelab", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--lmbda", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--student", help=argparse.SUPPRESS)
    parser.add_argument("--teacher", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    smoke = ["--vocab-size", "2048", "--loss-tokens", "64", "--dim", "32", "--train-vocab",
             "1024", "--student-dim", "64", "--student-layers", "1", "--teacher-dim", "64",
             "--teacher-layers", "2", "--rows", "8", "--words", "4", "--steps", "2",
             "--rounds", "1", "--batch-size", "2", "--max-new-tokens", "4",
             "--modes", "offline", "--parts", "loss,training"]  # fmt: skip
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
    # TRL's loss holds about 18 [tokens, vocab] fp32 tensors at its peak (8.6 GiB measured at
    # 1024 x 128256): it runs only where that fits in half the memory available now.
    trl_need = 18 * tokens * vocab * 4
    if importlib.util.find_spec("trl") is not None and trl_need <= _available_bytes() / 2:
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


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# -- 2. and 3. training ----------------------------------------------------------------------


def max_length(words: int, max_new_tokens: int) -> int:
    """Tokens a row can take: its chat (two messages of ``words`` words) or prompt + samples."""
    return 2 * words + max(words, max_new_tokens) + 32


def write_data(path: Path, rows: int, words: int) -> Path:
    """``rows`` single-turn chats: ``words`` one-token words and the assistant's reversal."""
    generator = random.Random(0)
    with path.open("w") as handle:
        for _ in range(rows):
            sample = [generator.choice(WORDS) for _ in range(words)]
            messages = [
                {"role": "user", "content": "Reverse the words: " + " ".join(sample)},
                {"role": "assistant", "content": " ".join(reversed(sample))},
            ]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path


def write_models(root: Path, args: argparse.Namespace, vocab: int) -> tuple[Path, Path]:
    """The random-init student and teacher folders at vocabulary ``vocab`` (tiny tokenizer)."""
    from _grpo_work import wide_config
    from _models import write_hf_checkpoint

    tiny = tiny_dir()
    tiny_config = json.loads((tiny / "config.json").read_text())
    folders = []
    for name, dim, layers in (
        ("student", args.student_dim, args.student_layers),
        ("teacher", args.teacher_dim, args.teacher_layers),
    ):
        folder = root / f"{name}_{vocab}"
        config = wide_config(dim, layers, vocab)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            config[key] = tiny_config[key]
        write_hf_checkpoint(folder, config)
        for file in TOKENIZER_FILES:
            shutil.copy(tiny / file, folder / file)
        folders.append(folder)
    return folders[0], folders[1]


class TrainingMemory:
    """Peak growth of this process's RSS from the start of training to the last update."""

    def __init__(self) -> None:
        self.baseline: int | None = None
        self.before = 0
        self.peak = 0

    def begin(self) -> None:
        """At the start of training (once): return free heap memory, reset the peak."""
        from _system import peak_rss_bytes, release_free_memory, reset_peak_rss, rss_bytes

        if self.baseline is None:
            self.before = peak_rss_bytes()
            release_free_memory()
            self.baseline = rss_bytes()
            reset_peak_rss()

    def snapshot(self) -> None:
        """After an update: the peak so far."""
        from _system import peak_rss_bytes

        self.peak = peak_rss_bytes()

    def figures(self) -> dict[str, int]:
        """The growth, the baseline and the process's whole peak."""
        return {
            "growth_bytes": max(0, self.peak - (self.baseline or 0)),
            "baseline_bytes": self.baseline or 0,
            "process_peak_bytes": max(self.before, self.peak),
        }


class StepClock:
    """Wall and CPU seconds of each step, and the scored tokens it counted."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def start(self) -> None:
        """A step begins."""
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self, scored_tokens: int) -> None:
        """The step's update is done."""
        self.steps.append(
            {
                "tokens": scored_tokens,
                "seconds": time.perf_counter() - self._wall,
                "cpu_seconds": time.process_time() - self._cpu,
            }
        )


def tunelab_worker(args: argparse.Namespace) -> None:
    """The real distill_distributed recipe in this (torchrun) process, timed and measured."""
    from tunelab.lifecycle import recipe_main
    from tunelab.training import AfterStep

    spec = importlib.util.spec_from_file_location("distill_distributed", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    memory, clock = TrainingMemory(), StepClock()
    start_step, after_step = AfterStep.start_step, AfterStep.__call__

    def timed_start(self: AfterStep) -> None:
        memory.begin()
        clock.start()
        start_step(self)

    def measured_after(self: AfterStep, *step, num_tokens: float, **kwargs) -> None:
        # Before the step's logging, export and save: the update is done.
        memory.snapshot()
        clock.stop(int(num_tokens))
        after_step(self, *step, num_tokens=num_tokens, **kwargs)

    AfterStep.start_step, AfterStep.__call__ = timed_start, measured_after
    out = Path(args.result).parent / f"tunelab_out_{Path(args.result).stem}"
    length = max_length(args.words, args.max_new_tokens)
    recipe_main(
        recipe.main,
        recipe.ARGS,
        ["--config", "tiny/distill", f"output_dir={out}", f"model.path={args.student}",
         f"teacher.path={args.teacher}", "~val_dataset", f"tokenizer.max_seq_len={length}",
         "dataset._component_=tunelab.data.chat_dataset", f"dataset.data_files={args.data}",
         "dataset.template=auto", f"dataset.max_seq_len={length}",
         "loss._component_=tunelab.losses.GeneralizedJSDLoss", "loss.beta=0.5",
         f"on_policy.lmbda={args.lmbda}", f"on_policy.max_new_tokens={args.max_new_tokens}",
         "lr_scheduler.num_warmup_steps=0", f"schedule.batch_size={args.batch_size}",
         f"schedule.max_steps_per_epoch={args.steps}", "checkpoint.save_every_n_steps=1000",
         "checkpoint.enable_async_checkpointing=false", "lora.dropout=0.0"],
    )  # fmt: skip
    Path(args.result).write_text(json.dumps({"steps": clock.steps, **memory.figures()}))


def trl_worker(args: argparse.Namespace) -> None:
    """GKDTrainer on the same folders, data, LoRA and lengths, timed and measured."""
    import datasets
    import torch
    import transformers
    from peft import LoraConfig
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    memory, clock, scored = TrainingMemory(), StepClock(), []

    class Counting(GKDTrainer):
        def compute_loss(self, model, inputs, *rest, **kwargs):
            scored.append(int((inputs["labels"][:, 1:] != -100).sum()))
            return super().compute_loss(model, inputs, *rest, **kwargs)

    class Measure(transformers.TrainerCallback):
        def on_train_begin(self, *_, **__):
            memory.begin()

        def on_step_begin(self, *_, **__):
            clock.start()

        def on_step_end(self, *_, **__):
            memory.snapshot()
            clock.stop(scored[-1])

    torch.manual_seed(0)
    config = GKDConfig(
        output_dir=str(Path(args.result).parent / f"trl_out_{Path(args.result).stem}"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        lmbda=args.lmbda,
        beta=0.5,
        temperature=1.0,
        max_new_tokens=args.max_new_tokens,
        max_length=max_length(args.words, args.max_new_tokens),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        disable_dropout=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Counting(
        model=transformers.AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32),
        teacher_model=transformers.AutoModelForCausalLM.from_pretrained(
            args.teacher, dtype=torch.float32
        ),
        args=config,
        train_dataset=datasets.load_dataset("json", data_files=args.data)["train"],
        processing_class=transformers.AutoTokenizer.from_pretrained(args.student),
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS),
        callbacks=[Measure()],
    )
    # transformers maps the safetensors files and its parameters may be views of the mapping:
    # read every weight now, so that paging them in is in the baseline (as tunelab's loaded
    # copies are), not in the training's growth.
    with torch.no_grad():
        for param in [*trainer.model.parameters(), *trainer.teacher_model.parameters()]:
            param.sum()
    trainer.train()
    Path(args.result).write_text(json.dumps({"steps": clock.steps, **memory.figures()}))


def run_side(side: str, args: argparse.Namespace, models: tuple[Path, Path], data: Path,
             result: Path, *, lmbda: float, steps: int, batch_size: int) -> dict:  # fmt: skip
    """One side's training in a fresh process; its figures and the load average before it."""
    load = os.getloadavg()[0]
    worker = ["--worker", side, "--lmbda", str(lmbda), "--student", str(models[0]),
              "--teacher", str(models[1]), "--data", str(data), "--result", str(result),
              "--steps", str(steps), "--batch-size", str(batch_size),
              "--words", str(args.words), "--max-new-tokens", str(args.max_new_tokens)]  # fmt: skip
    if side == "tunelab":
        done = torchrun(__file__, worker, 1, capture_output=True, text=True)
    else:
        done = subprocess.run(
            [sys.executable, __file__, *worker], env=launch_env(1), capture_output=True, text=True
        )
    if done.returncode != 0:
        raise RuntimeError(f"the {side} worker failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    figures = json.loads(result.read_text())
    timed = figures["steps"][1:]
    return {
        **figures,
        "load": load,
        "tokens": sum(step["tokens"] for step in timed),
        "seconds": sum(step["seconds"] for step in timed),
        "cpu_seconds": sum(step["cpu_seconds"] for step in timed),
        "scored_per_step": [step["tokens"] for step in figures["steps"]],
    }


def _same_work(ours: dict, theirs: dict) -> str:
    if ours["scored_per_step"] == theirs["scored_per_step"]:
        return "same scored tokens in every step"
    return (
        f"scored tokens per step differ: tunelab {ours['scored_per_step']}, "
        f"TRL {theirs['scored_per_step']}"
    )


def memory_row(figure: str, ours: list[dict], theirs: list[dict]) -> Row:
    """Training growth of RSS, the largest round of each side."""
    mine = max(run["growth_bytes"] for run in ours)
    other = max(run["growth_bytes"] for run in theirs)
    return Row(
        figure, mebibytes(mine), mebibytes(other), f"{mine / other:.2f}x", "<= 0.5x",
        mine <= 0.5 * other,
    )  # fmt: skip


def training_rows(args: argparse.Namespace, scratch: Path) -> tuple[list[Row], list[str]]:
    """Offline and on-policy at the realistic shape: tokens/s (ABBA rounds) and memory."""
    data = write_data(scratch / "chat_rows.jsonl", args.rows, args.words)
    models = write_models(scratch, args, args.train_vocab)
    sides = ["tunelab", "trl"] if importlib.util.find_spec("trl") else ["tunelab"]
    rows, notes = [], []
    for mode, lmbda in (("offline", 0.0), ("on-policy", 1.0)):
        if mode not in args.modes.split(","):
            continue
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for round_index in range(args.rounds):
            order = sides if round_index % 2 == 0 else sides[::-1]
            for side in order:
                result = scratch / f"{side}_{mode}_{round_index}.json"
                runs[side].append(
                    run_side(
                        side,
                        args,
                        models,
                        data,
                        result,
                        lmbda=lmbda,
                        steps=args.steps,
                        batch_size=args.batch_size,
                    )  # fmt: skip
                )
        rows += _speed_rows(mode, runs, notes)
        if "trl" in runs:
            rows.append(memory_row(f"{mode} training memory (RSS growth)", runs["tunelab"],
                                   runs["trl"]))  # fmt: skip
            notes.append(
                f"{mode} memory: tunelab growth "
                + ", ".join(mebibytes(run["growth_bytes"]) for run in runs["tunelab"])
                + " over a start of " + mebibytes(runs["tunelab"][0]["baseline_bytes"])
                + "; TRL " + ", ".join(mebibytes(run["growth_bytes"]) for run in runs["trl"])
                + " over " + mebibytes(runs["trl"][0]["baseline_bytes"])
                + "; whole process peaks "
                + mebibytes(max(run["process_peak_bytes"] for run in runs["tunelab"])) + " and "
                + mebibytes(max(run["process_peak_bytes"] for run in runs["trl"]))
            )  # fmt: skip
    return rows, notes


def _speed_rows(mode: str, runs: dict[str, list[dict]], notes: list[str]) -> list[Row]:
    # Tokens/s per wall second and per CPU second: the medians of the rounds' ratios.
    def rates(side: str, clock: str) -> list[float]:
        return [run["tokens"] / run[clock] for run in runs[side]]

    rows = []
    for clock, label in (("seconds", "tokens/s"), ("cpu_seconds", "tokens per CPU-second")):
        ours = rates("tunelab", clock)
        if "trl" not in runs:
            rows.append(Row(f"{mode} {label}", f"{statistics.median(ours):.1f}", "no trl", "-",
                            ">= 1.3x", None))  # fmt: skip
            continue
        theirs = rates("trl", clock)
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        ratio = statistics.median(ratios)
        rows.append(
            Row(f"{mode} {label}", f"{statistics.median(ours):.1f}",
                f"{statistics.median(theirs):.1f}", f"{ratio:.2f}x", ">= 1.3x", ratio >= 1.3)
        )  # fmt: skip
        notes.append(
            f"{mode} {label} per round (tunelab, TRL, ratio, load before each): "
            + "; ".join(
                f"{a:.1f}, {b:.1f}, {a / b:.2f}x, load {x['load']:.1f}/{y['load']:.1f}"
                for a, b, x, y in zip(ours, theirs, runs["tunelab"], runs["trl"], strict=True)
            )
        )  # fmt: skip
    if "trl" in runs:
        notes.append(
            f"{mode} work: "
            + "; ".join(_same_work(a, b) for a, b in zip(runs["tunelab"], runs["trl"], strict=True))
            + f" (tunelab {runs['tunelab'][0]['scored_per_step']} scored tokens per step)"
        )
    return rows


def memory_rows(args: argparse.Namespace, scratch: Path) -> tuple[list[Row], list[str]]:
    """Training memory at vocabulary ``--memory-vocab``: one run per side and mode."""
    if importlib.util.find_spec("trl") is None:
        return [], ["memory at a large vocabulary: no trl"]
    data = scratch / "chat_rows.jsonl"
    if not data.exists():
        write_data(data, args.rows, args.words)
    models = write_models(scratch, args, args.memory_vocab)
    rows, notes = [], []
    for mode, lmbda in (("offline", 0.0), ("on-policy", 1.0)):
        if mode not in args.modes.split(","):
            continue
        runs = {
            side: [run_side(side, args, models, data, scratch / f"{side}_{mode}_memory.json",
                            lmbda=lmbda, steps=args.memory_steps,
                            batch_size=args.memory_batch_size)]
            for side in ("tunelab", "trl")
        }  # fmt: skip
        where = f"vocabulary {args.memory_vocab}, batch {args.memory_batch_size}"
        rows.append(memory_row(f"{mode} training memory (RSS growth, {where})", runs["tunelab"],
                               runs["trl"]))  # fmt: skip
        notes.append(f"{mode} at {where}: " + _same_work(runs["tunelab"][0], runs["trl"][0]))
    return rows, notes


def main() -> None:
    """Run the parts and print one table."""
    args = parse_args()
    if args.worker == "trl":
        trl_worker(args)
        return
    if args.worker == "tunelab":
        tunelab_worker(args)
        return
    parts = args.parts.split(",")
    rows, notes = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        # Training first: its processes start from this one while it is still small.
        for part, build in (("training", training_rows), ("memory", memory_rows)):
            if part in parts:
                part_rows, part_notes = build(args, Path(scratch))
                rows += part_rows
                notes += part_notes
        rows += loss_rows(args) if "loss" in parts else []
    print_table(
        "distill: tunelab distill_distributed vs TRL GKDTrainer",
        rows,
        notes=[
            f"loss: fp32, hidden size {args.dim}. Training: 1 process each, student "
            f"{args.student_dim} x {args.student_layers}, teacher {args.teacher_dim} x "
            f"{args.teacher_layers}, vocabulary {args.train_vocab}, batch {args.batch_size}, "
            f"{args.steps} steps (first untimed), {args.rounds} rounds, {args.words}-word "
            f"messages, {args.max_new_tokens} new tokens on-policy, LoRA r=8 on every "
            "projection, generalized JSD beta 0.5.",
            *notes,
        ],
    )


if __name__ == "__main__":
    main()
