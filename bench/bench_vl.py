"""Vision-language: image preprocessing and LoRA SFT throughput against transformers and TRL.

Run (each side in its own process, one after the other, ``--rounds`` times, the order
alternating):

    python bench/bench_vl.py
    python bench/bench_vl.py --family qwen3_vl --rounds 4 --steps 16

Two comparisons, side by side in one run:

- **Preprocessing, images/s.** ``tunelab.data.images.ImageProcessing`` against the family's
  transformers image processor as ``AutoImageProcessor`` builds it here (without torchvision:
  ``Qwen2VLImageProcessorPil``), with the hub checkpoints' settings (Qwen2.5-VL-7B-Instruct's
  and Qwen3-VL-8B-Instruct's ``preprocessor_config.json``), on the same decoded pillow images of
  several sizes; each image's pixel values (within 1e-6) and grid are checked equal before
  any figure is printed. One process with one thread does both sides, the order alternating
  per round; each side is timed by wall and by CPU seconds (``time.process_time``). The
  split is printed per size: each side's CPU ms per image (median of rounds) and, timed on
  its own over the same images, pillow's bicubic resize that both sides make (the same call).
- **Training, tokens/s.** LoRA SFT (r=8, alpha=16, dropout 0, every projection of the
  language model, as ``tiny/vl_lora``) on the embedded tiny model of ``--family`` in fp32, on
  the same chat rows with images (the embedded ``tiny_vl/chat.jsonl``, repeated, absolute
  image paths), ``--batch-size`` rows a step in file order, AdamW with clipping at 1.0:

  - ``tunelab``: the library pieces ``recipes/lora_finetune_distributed.py`` runs, in its
    order (``image_chat_dataset`` tokenised once into its cache before the steps, the
    recipe's loader with ``sft_collate``, which reads and preprocesses each batch's images,
    ``batch_loss`` with the chunked output layer, ``OptimizerStep``), on one process;
  - ``TRL``: ``trl.SFTTrainer`` on the same checkpoint loaded by ``transformers`` (the
    family's ``*ForConditionalGeneration``, SDPA) with a PEFT ``LoraConfig`` on the same
    language-model linears (the vision tower's like-named MLPs left out, as tunelab's), the
    family's processor (its tokenizer, chat template and image processor; the video processor
    left out, its class needs torchvision) and the rows' images as a ``datasets`` image
    column; TRL's collator renders, tokenises and preprocesses each batch. Tuned as a careful
    user would for fp32: no bf16 autocast, no gradient checkpointing, sequential sampling,
    logging and saving off.

  Each step is timed with the loading of its batch (tunelab: ``next(batches)`` to the
  optimizer step; TRL: from one ``on_step_end`` to the next, which spans the Trainer's batch
  fetch), one untimed warm-up step first. Tokens: the non-padding tokens of the timed steps'
  rows, image tokens included; both sides' counts are checked equal per round. tunelab's
  one tokenising pass (cached for later epochs and runs) is printed, not counted.

Each side runs with ``--threads`` intra-op threads (default 1). The ratios are the claim; the
absolute figures depend on the machine and its load (printed).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from _common import (
    LORA_TARGETS,
    Row,
    add_trainer_bench_args,
    alternating_rounds,
    parse_bench_args,
    print_table,
    run_json_worker,
    run_trainer_rounds,
    throughput_row,
    throughput_rows,
    trainer_bench_main,
    trl_settings,
)

TARGET_RATIO = 1.3
# Each family: its embedded tiny model, transformers' model and processor classes, and the
# hub checkpoint's image settings (Qwen/Qwen2.5-VL-7B-Instruct, Qwen/Qwen3-VL-8B-Instruct).
FAMILIES = {
    "qwen2_5_vl": {
        "assets": "tiny_vl",
        "model_class": "Qwen2_5_VLForConditionalGeneration",
        "processor_class": "Qwen2_5_VLProcessor",
        "hub_preprocessing": {
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
        },
    },
    "qwen3_vl": {
        "assets": "tiny_qwen3_vl",
        "model_class": "Qwen3VLForConditionalGeneration",
        "processor_class": "Qwen3VLProcessor",
        "hub_preprocessing": {
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    },
}
IMAGE_SIZES = ("320x240", "640x480", "1280x720", "1920x1080")
"""Width x height of the preprocessing bench's images (make-bench size)."""


def parse_args() -> argparse.Namespace:
    """Command-line flags (the orchestrator's, plus the workers' own)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2_5_vl", choices=sorted(FAMILIES),
                        help="the tiny model the training rows run on")  # fmt: skip
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per side")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per training step")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--sizes", default=",".join(IMAGE_SIZES),
                        help="preprocessing image sizes, WIDTHxHEIGHT,...")  # fmt: skip
    parser.add_argument("--images", type=int, default=8,
                        help="preprocessed images per size, side and round")  # fmt: skip
    parser.add_argument("--preprocess-result", default=None, help=argparse.SUPPRESS)
    add_trainer_bench_args(parser)
    smoke = ["--steps", "1", "--batch-size", "2", "--rounds", "1", "--sizes", "96x64",
             "--images", "1"]  # fmt: skip
    return parse_bench_args(parser, smoke)


# -- preprocessing -----------------------------------------------------------------------------


def _test_image(width: int, height: int, seed: int):
    """A smooth gradient with noise (its content does not change the work; decoded once)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    rows = np.linspace(0, 255, height)[:, None, None]
    columns = np.linspace(0, 255, width)[None, :, None]
    base = (rows + columns) / 2 + rng.normal(0, 20, (height, width, 3))
    return Image.fromarray(base.clip(0, 255).astype(np.uint8), mode="RGB")


def _time_preprocessing(sides: dict, images: list, side: str, _round: int) -> dict[str, float]:
    """Wall and CPU seconds of one side preprocessing ``images`` one at a time."""
    process = sides[side]
    began, began_cpu = time.perf_counter(), time.process_time()
    for image in images:
        if side == "tunelab":
            process(image)
        else:
            process(images=[image])
    return {
        "tokens": len(images),  # images: throughput_row's rate is "tokens" over time
        "seconds": time.perf_counter() - began,
        "cpu_seconds": time.process_time() - began_cpu,
    }


def _resize_cpu_seconds(ours, images: list) -> float:
    """CPU seconds per image of the pillow resize both sides make (bicubic, the same sizes)."""
    from PIL import Image

    from tunelab.data.images import to_rgb

    sizes = [ours.resized_size(image.height, image.width) for image in images]
    if all(size == (image.height, image.width) for size, image in zip(sizes, images)):
        return 0.0  # neither side resizes
    seconds = []
    for _ in range(3):
        began = time.process_time()
        for (height, width), image in zip(sizes, images):
            to_rgb(image).resize((width, height), Image.Resampling.BICUBIC)
        seconds.append((time.process_time() - began) / len(images))
    return min(seconds)


def preprocess_worker(args: argparse.Namespace) -> dict:
    """Both preprocessing sides in this one process, each size alternating their order.

    Returns:
        ``{family: {size: {side: [{"images", "seconds", "cpu_seconds"} per round]}}}``, the
        transformers processor's class per family under ``"classes"`` and the CPU seconds
        per image of the shared pillow resize under ``"resize"`` (``{family: {size: s}}``).
    """
    import torch
    from transformers import AutoImageProcessor

    from tunelab.data.images import ImageProcessing

    torch.set_num_threads(args.threads)
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    figures: dict = {"classes": {}, "resize": {}}
    for family, spec in FAMILIES.items():
        folder = Path(tempfile.mkdtemp(prefix=f"bench_vl_{family}_"))
        settings = {"image_processor_type": "Qwen2VLImageProcessor", **spec["hub_preprocessing"]}
        (folder / "preprocessor_config.json").write_text(json.dumps(settings))
        theirs = AutoImageProcessor.from_pretrained(folder)
        ours = ImageProcessing.from_preprocessor_config(settings)
        figures["classes"][family] = type(theirs).__name__
        sides = {
            "tunelab": ours,
            "transformers": partial(theirs, return_tensors="pt"),
        }
        figures[family] = {}
        figures["resize"][family] = {}
        for width, height in sizes:
            images = [_test_image(width, height, seed) for seed in range(args.images)]
            pixels, grid = ours(images[0])
            reference = theirs(images=[images[0]], return_tensors="pt")
            gap = float((pixels - reference["pixel_values"]).abs().max())
            if list(grid) != reference["image_grid_thw"][0].tolist() or gap > 1e-6:
                raise SystemExit(
                    f"{family} {width}x{height}: tunelab's pixels differ from "
                    f"{type(theirs).__name__}'s (grid {list(grid)} vs "
                    f"{reference['image_grid_thw'][0].tolist()}, max gap {gap:.2e})"
                )
            run_side = partial(_time_preprocessing, sides, images)
            figures[family][f"{width}x{height}"] = alternating_rounds(
                run_side, list(sides), args.rounds
            )
            figures["resize"][family][f"{width}x{height}"] = _resize_cpu_seconds(ours, images)
    return figures


def _images(note: str) -> str:
    """A throughput note of ``throughput_row`` about images, not tokens."""
    return note.replace("tokens", "images").replace("per cpu_seconds", "per CPU-second")


def _split_note(family: str, size: str, results: dict, resize_seconds: float) -> str:
    """Each side's CPU ms per image (median of rounds), and how much of it the shared resize is."""
    per_image = {
        side: 1000 * statistics.median(run["cpu_seconds"] / run["tokens"] for run in runs)
        for side, runs in results.items()
    }
    resize = 1000 * resize_seconds
    if not resize_seconds:
        sides = "; ".join(f"{side} {ms:.2f}" for side, ms in per_image.items())
        return f"{family} {size}: CPU ms per image: {sides} (no resize at this size)"
    return (
        f"{family} {size}: CPU ms per image: "
        + "; ".join(
            f"{side} {ms:.2f} (the rest after the resize {ms - resize:.2f})"
            for side, ms in per_image.items()
        )
        + f"; pillow's bicubic resize, the same call on both sides: {resize:.2f}"
    )


def preprocess_rows(figures: dict) -> tuple[list[Row], list[str]]:
    """Per family: an images/s row per size, and one images-per-CPU-second row over all sizes."""
    rows, notes = [], []
    for family in FAMILIES:
        theirs = figures["classes"][family]
        totals: dict[str, list[dict[str, float]]] = {}
        for size, results in figures[family].items():
            figure = f"{family} preprocessing, {size}: images/s (tunelab / {theirs})"
            row, round_notes = throughput_row(figure, results, TARGET_RATIO, theirs="transformers")
            rows.append(row)
            notes.append(f"{family} {size}: " + _images(round_notes[-1]))
            notes.append(_split_note(family, size, results, figures["resize"][family][size]))
            for side, runs in results.items():
                per_round = totals.setdefault(side, [dict.fromkeys(runs[0], 0.0) for _ in runs])
                for total, run in zip(per_round, runs, strict=True):
                    for key, value in run.items():
                        total[key] += value
        figure = f"{family} preprocessing, all sizes: images per CPU-second (tunelab / {theirs})"
        row, round_notes = throughput_row(
            figure, totals, TARGET_RATIO, theirs="transformers", time_key="cpu_seconds"
        )
        rows.append(row)
        notes.append(f"{family} all sizes: " + _images(round_notes[-1]))
    return rows, notes


def run_preprocessing(args: argparse.Namespace, scratch: Path) -> dict:
    """The preprocessing worker in its own process, ``--threads`` threads."""
    result = scratch / "preprocess.json"
    command = [
        sys.executable, __file__, "--preprocess-result", str(result), "--sizes", args.sizes,
        "--images", str(args.images), "--rounds", str(args.rounds),
        "--threads", str(args.threads),
    ]  # fmt: skip
    return run_json_worker(command, result, args.threads, "preprocessing")


# -- training ----------------------------------------------------------------------------------


def family_dir(family: str) -> Path:
    """The embedded tiny model of ``family``."""
    from tunelab._paths import assets_dir

    return assets_dir() / FAMILIES[family]["assets"]


def write_rows(path: Path, count: int) -> None:
    """``count`` rows of the embedded ``tiny_vl/chat.jsonl`` in file order (repeated), as
    content parts with absolute image paths (the ``images``-column rows converted)."""
    from tunelab._paths import assets_dir

    source = assets_dir() / "tiny_vl"
    rows = [json.loads(line) for line in (source / "chat.jsonl").read_text().splitlines()]
    with path.open("w") as out:
        for index in range(count):
            row = rows[index % len(rows)]
            files = iter(row.get("images") or [])
            messages = []
            for message in row["messages"]:
                content = message["content"]
                if isinstance(content, str) and "<image>" in content:
                    parts = []
                    for number, piece in enumerate(content.split("<image>")):
                        if number:
                            parts.append({"type": "image", "image": next(files)})
                        if piece:
                            parts.append({"type": "text", "text": piece})
                    content = parts
                if isinstance(content, list):
                    content = [
                        {**part, "image": str(source / part["image"])}
                        if part.get("type") == "image" else part
                        for part in content
                    ]  # fmt: skip
                messages.append({**message, "content": content})
            out.write(json.dumps({"messages": messages}) + "\n")


def tunelab_worker(args: argparse.Namespace) -> dict:
    """The tunelab side: the recipe's step with its batch's loading, timed per optimizer step."""
    import torch

    import tunelab.peft as peft
    from tunelab.config.lora import LoRAArgs
    from tunelab.data import image_chat_dataset, load_tokenizer, sft_collate
    from tunelab.losses import CrossEntropyLoss
    from tunelab.training import (
        OptimizerStep,
        adamw,
        batch_loss,
        global_token_count,
        load_model,
        output_layer,
    )
    from tunelab.training.setup import build_dataloader

    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.model_dir, max_seq_len=args.max_length)
    began = time.perf_counter()
    dataset = image_chat_dataset(
        tokenizer, source="json", data_files=args.data, max_seq_len=args.max_length,
        cache_dir=str(Path(args.result).with_suffix("")), num_proc=1,
    )  # fmt: skip
    tokenize_seconds = time.perf_counter() - began
    loader, _ = build_dataloader(
        dataset, batch_size=args.batch_size, collate_fn=sft_collate(tokenizer), seed=0,
        shuffle=False, pad_id=tokenizer.pad_id,
    )  # fmt: skip
    lora = LoRAArgs(rank=8, alpha=16.0, dropout=0.0, targets=LORA_TARGETS)
    model = load_model(args.model_dir, device=torch.device("cpu"), dtype=torch.float32, lora=lora)
    model.train()
    trainable = list(peft.get_adapter_params(model).values())
    optimizer_step = OptimizerStep(
        adamw(trainable, lr=1e-4, weight_decay=0.0), trainable, clip_grad_norm=1.0
    )
    output = output_layer(model)
    loss_fn = CrossEntropyLoss()
    seconds, cpu_seconds, tokens = 0.0, 0.0, 0
    batches = iter(loader)
    for step in range(1 + args.steps):
        began, began_cpu = time.perf_counter(), time.process_time()
        batch = next(batches)
        num_tokens = global_token_count([batch])
        loss_sum, _ = batch_loss(loss_fn, model, batch, output)
        (loss_sum / num_tokens).backward()
        optimizer_step(loss=float(loss_sum.detach() / num_tokens), step=step + 1)
        elapsed, elapsed_cpu = time.perf_counter() - began, time.process_time() - began_cpu
        if step > 0:  # the first step warms up
            seconds += elapsed
            cpu_seconds += elapsed_cpu
            tokens += int((batch["tokens"] != tokenizer.pad_id).sum())
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "tokens": tokens,
        "tokenize_seconds": tokenize_seconds,
    }


def _trl_processor(family: str, model_dir: str):
    """The family's transformers processor for the tiny model, without its video processor."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    base = getattr(transformers, FAMILIES[family]["processor_class"])

    class Processor(base):
        """The video processor's class needs torchvision, absent here; images need none."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name != "video_processor":
                return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return Processor(
        image_processor=AutoImageProcessor.from_pretrained(model_dir),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def trl_worker(args: argparse.Namespace) -> dict:
    """The TRL side: SFTTrainer's own loop and collator, each step timed by a callback."""
    import datasets
    import torch
    import transformers
    import trl
    from peft import LoraConfig
    from transformers import TrainerCallback

    torch.manual_seed(0)
    family = next(f for f, spec in FAMILIES.items() if spec["assets"] == Path(args.model_dir).name)
    model_class = getattr(transformers, FAMILIES[family]["model_class"])
    model = model_class.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    processor = _trl_processor(family, args.model_dir)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    records = []
    for row in rows:
        files = []
        messages = []
        for message in row["messages"]:
            content = message["content"]
            if isinstance(content, str):  # one layout for every message (an Arrow column)
                content = [{"type": "text", "text": content}]
            files += [part["image"] for part in content if part.get("type") == "image"]
            content = [{"type": "image"} if part.get("type") == "image" else part
                       for part in content]  # fmt: skip
            messages.append({**message, "content": content})
        records.append({"messages": messages, "images": files})
    dataset = datasets.Dataset.from_list(records)
    dataset = dataset.cast_column("images", datasets.List(datasets.Image()))
    step_ends: list[tuple[float, float]] = []
    batch_tokens: list[int] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append((time.perf_counter(), time.process_time()))

    config = trl.SFTConfig(**trl_settings(args), train_sampling_strategy="sequential")
    language_model = "|".join(LORA_TARGETS)
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=rf".*language_model.*\.({language_model})",
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=processor,
        peft_config=lora,
        callbacks=[StepTimes()],
    )
    collate = trainer.data_collator

    def counted(examples):
        batch = collate(examples)
        batch_tokens.append(int(batch["attention_mask"].sum()))
        return batch

    trainer.data_collator = counted
    trainer.train()
    timed = list(zip(step_ends, step_ends[1:]))
    return {
        "seconds": sum(end[0] - start[0] for start, end in timed),
        "cpu_seconds": sum(end[1] - start[1] for start, end in timed),
        "tokens": sum(batch_tokens[1 : 1 + args.steps]),
    }


def orchestrate(args: argparse.Namespace) -> None:
    """Preprocessing rounds, then training rounds (the order alternating), then the table."""
    if args.model != "tiny":
        raise SystemExit("--model: the VL bench trains the embedded tiny model of --family")
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench_vl_"))
    scratch.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    preprocessing = run_preprocessing(args, scratch)
    data = scratch / "vl_chat.jsonl"
    write_rows(data, args.batch_size * (1 + args.steps))
    model_dir = family_dir(args.family)
    results = run_trainer_rounds(__file__, args, data, model_dir, scratch)
    if "TRL" in results:
        ours = [int(run["tokens"]) for run in results["tunelab"]]
        theirs = [int(run["tokens"]) for run in results["TRL"]]
        if ours != theirs:
            raise SystemExit(
                f"the sides trained different tokens per round (tunelab {ours}, TRL {theirs}): "
                "their rendering of the rows differs, the ratio would mean nothing"
            )
    rows, notes = preprocess_rows(preprocessing)
    figure = (
        f"{args.family} tiny, LoRA SFT with images, 1 process: tokens/s (tunelab / TRL SFTTrainer)"
    )
    train_rows, round_notes = throughput_rows(figure, results, TARGET_RATIO)
    tokenize = statistics.median(run["tokenize_seconds"] for run in results["tunelab"])
    notes = [
        f"preprocessing: the hub checkpoints' image settings, {args.images} images per size, "
        f"side and round, {args.rounds} round(s), the order alternating, one process with "
        f"{args.threads} thread(s); transformers' processors: {preprocessing['classes']}.",
        *notes,
        f"training: {model_dir.name}, LoRA r=8 on the language model's projections, fp32, "
        f"{args.batch_size} rows a step (in file order), {args.steps} timed steps after one "
        f"warm-up, each with its batch's loading; one process per side with {args.threads} "
        f"intra-op thread(s), one side at a time; tunelab's tokenising pass over "
        f"{args.batch_size * (1 + args.steps)} rows before the steps (cached): "
        f"{tokenize:.2f} s. {os.cpu_count()} cores; load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after.",
        *round_notes,
    ]
    print_table(
        "Vision-language: preprocessing vs transformers, LoRA SFT vs TRL SFTTrainer",
        [*rows, *train_rows],
        notes,
    )


def main() -> None:
    """A worker or the orchestrator, by the flags."""
    args = parse_args()
    if args.preprocess_result:
        Path(args.preprocess_result).write_text(json.dumps(preprocess_worker(args)))
        return
    workers = {"tunelab": tunelab_worker, "TRL": trl_worker}
    trainer_bench_main(args, workers, orchestrate)


if __name__ == "__main__":
    main()
