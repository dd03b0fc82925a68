"""Vision-language: image preprocessing and LoRA SFT throughput against transformers and TRL.

Run (each side in its own process, one after the other, ``--rounds`` times, the order
alternating):

    python bench/bench_vl.py
    python bench/bench_vl.py --family qwen3_vl --rounds 4 --steps 16
    python bench/bench_vl.py --model wide --parts training --rounds 2   # make bench's vl_wide

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

``--model wide`` trains a realistic shape instead of the embedded tiny model, where per-call
overhead dominates: a random-init checkpoint of the family (``wide_model_dir``: language model
768 wide, 4 layers, GQA 12/4, MLP 2048, vocabulary 2048; vision tower 384 wide, 4 blocks)
written once under the scratch folder with transformers' classes and loaded by both sides from
those files, the tiny model's tokenizer and images, the images scaled up to 224 x 224
(Qwen2.5-VL) or 256 x 256 (Qwen3-VL) at least (64 image tokens each) and rows of up to 256
tokens; the same LoRA, rows, batch and checks. ``--parts training`` leaves the preprocessing
part out (it does not depend on the model).

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
WIDE_TEXT = {
    "vocab_size": 2048,
    "hidden_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2048,
    "max_position_embeddings": 4096,
}
"""``--model wide``'s language model (both families): the other benches' wide shape (GQA 12/4)."""
WIDE_VISION = {
    "qwen2_5_vl": {  # Qwen2.5-VL-7B's tower scaled down: gated SiLU MLP, windows of 112 px
        "depth": 4, "hidden_size": 384, "intermediate_size": 1024, "num_heads": 6,
        "window_size": 112, "fullatt_block_indexes": [3],
    },
    "qwen3_vl": {  # Qwen3-VL-8B's tower scaled down: GELU MLP, a 32 x 32 position table
        "depth": 4, "hidden_size": 384, "intermediate_size": 1536, "num_heads": 6,
        "patch_size": 16, "num_position_embeddings": 1024, "deepstack_visual_indexes": [1, 2],
    },
}  # fmt: skip
"""``--model wide``'s vision tower per family (its output is the language model's width)."""
WIDE_MROPE = {"qwen2_5_vl": [8, 12, 12], "qwen3_vl": [12, 10, 10]}
"""The hub's multimodal rotary sections (head_dim 128) halved for head_dim 64."""
WIDE_MIN_PIXELS = {"qwen2_5_vl": 224 * 224, "qwen3_vl": 256 * 256}
"""``--model wide``'s smallest image (the tiny model's images are scaled up to it): 256 patches,
64 image tokens per image, so the tower sees what a real image gives it."""
WIDE_MAX_LENGTH = 256
"""``--max-length`` of ``--model wide``: a row's ~70 text tokens and its 64-70 image tokens."""


def parse_args() -> argparse.Namespace:
    """Command-line flags (the orchestrator's, plus the workers' own)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2_5_vl", choices=sorted(FAMILIES),
                        help="the training rows' family (its tiny model or --model wide)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per side")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per training step")
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help=f"tokens per sequence (default 128; {WIDE_MAX_LENGTH} with --model wide)",
    )
    parser.add_argument(
        "--parts",
        default="preprocessing,training",
        help="what to run: preprocessing, training, trim (comma-separated; trim: tunelab's "
        "step with the last layer at the scored positions only against at every position)",
    )
    parser.add_argument("--sizes", default=",".join(IMAGE_SIZES),
                        help="preprocessing image sizes, WIDTHxHEIGHT,...")  # fmt: skip
    parser.add_argument("--images", type=int, default=8,
                        help="preprocessed images per size, side and round")  # fmt: skip
    parser.add_argument("--layers", type=int, default=WIDE_TEXT["num_hidden_layers"],
                        help="--model wide's language-model layers")  # fmt: skip
    parser.add_argument("--preprocess-result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trim-result", default=None, help=argparse.SUPPRESS)
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


def wide_model_dir(
    family: str, scratch: Path, layers: int = WIDE_TEXT["num_hidden_layers"]
) -> Path:
    """``--model wide`` of ``family``: a random-init checkpoint at a realistic width, written once.

    The language model is ``WIDE_TEXT`` (hidden 768, 4 layers, GQA 12/4, MLP 2048, vocabulary
    2048) and the vision tower ``WIDE_VISION[family]`` (4 blocks of width 384), built with
    transformers' config and model classes as the embedded tiny model is
    (``tunelab.assets.build_tiny_vl``) and saved with ``save_pretrained``; the tiny model's
    tokenizer (its ids all below the vocabulary) and image settings, images scaled up to at
    least ``WIDE_MIN_PIXELS[family]``. Both sides load these files.

    Args:
        family: A key of ``FAMILIES``.
        scratch: The bench's scratch folder; the model goes in ``wide_<family>`` under it
            (``wide_<family>_<layers>layers`` at another depth than ``WIDE_TEXT``'s).
        layers: The language model's layers (``--layers``).

    Returns:
        The model folder.
    """
    import shutil

    import torch
    import transformers

    default = layers == WIDE_TEXT["num_hidden_layers"]
    folder = scratch / (f"wide_{family}" if default else f"wide_{family}_{layers}layers")
    if (folder / "model.safetensors").exists():
        return folder
    tiny = family_dir(family)
    tiny_config = json.loads((tiny / "config.json").read_text())
    tiny_text = tiny_config["text_config"]
    text = {
        **WIDE_TEXT,
        "num_hidden_layers": layers,
        "rope_parameters": {**tiny_text["rope_parameters"], "mrope_section": WIDE_MROPE[family]},
        **{key: tiny_text[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    }
    vision = {**WIDE_VISION[family], "out_hidden_size": WIDE_TEXT["hidden_size"]}
    token_ids = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    config_class = getattr(transformers, FAMILIES[family]["model_class"]).config_class
    config = config_class(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        **{key: tiny_config[key] for key in token_ids},
    )
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES[family]["model_class"])(config)
    model.save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder / name)
    preprocessing = json.loads((tiny / "preprocessor_config.json").read_text())
    preprocessing["min_pixels"] = WIDE_MIN_PIXELS[family]
    preprocessing["max_pixels"] = max(preprocessing["max_pixels"], 4 * WIDE_MIN_PIXELS[family])
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessing, indent=2) + "\n")
    return folder


def shape_label(model_dir: Path) -> str:
    """The training rows' model shape, read from its ``config.json``."""
    config = json.loads((model_dir / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    return (
        f"LM {text['hidden_size']} x {text['num_hidden_layers']} layers, GQA "
        f"{text['num_attention_heads']}/{text['num_key_value_heads']}, MLP "
        f"{text['intermediate_size']}, vocabulary {text['vocab_size']}; vision "
        f"{vision['hidden_size']} x {vision['depth']} blocks"
    )


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


def _tunelab_setup(args: argparse.Namespace) -> dict:
    """The recipe's set-up: tokenizer, dataset (tokenised into its cache), loader, LoRA model.

    Returns:
        ``tokenizer``, ``loader``, ``model`` (training mode), ``trainable`` (the adapters),
        ``output`` (the chunked output layer) and ``tokenize_seconds``.
    """
    import torch

    import tunelab.peft as peft
    from tunelab.config.lora import LoRAArgs
    from tunelab.data import image_chat_dataset, load_tokenizer, sft_collate
    from tunelab.training import load_model, output_layer
    from tunelab.training.setup import build_dataloader

    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.model_dir, max_seq_len=args.max_length)
    began = time.perf_counter()
    dataset = image_chat_dataset(
        tokenizer, source="json", data_files=args.data, max_seq_len=args.max_length,
        cache_dir=str(Path(args.result or args.trim_result).with_suffix("")), num_proc=1,
    )  # fmt: skip
    tokenize_seconds = time.perf_counter() - began
    loader, _ = build_dataloader(
        dataset, batch_size=args.batch_size, collate_fn=sft_collate(tokenizer), seed=0,
        shuffle=False, pad_id=tokenizer.pad_id,
    )  # fmt: skip
    lora = LoRAArgs(rank=8, alpha=16.0, dropout=0.0, targets=LORA_TARGETS)
    model = load_model(args.model_dir, device=torch.device("cpu"), dtype=torch.float32, lora=lora)
    model.train()
    return {
        "tokenizer": tokenizer,
        "loader": loader,
        "model": model,
        "trainable": list(peft.get_adapter_params(model).values()),
        "output": output_layer(model),
        "tokenize_seconds": tokenize_seconds,
    }


def tunelab_worker(args: argparse.Namespace) -> dict:
    """The tunelab side: the recipe's step with its batch's loading, timed per optimizer step."""
    from tunelab.losses import CrossEntropyLoss
    from tunelab.training import OptimizerStep, adamw, batch_loss, global_token_count

    setup = _tunelab_setup(args)
    tokenizer, loader, model = setup["tokenizer"], setup["loader"], setup["model"]
    trainable, output = setup["trainable"], setup["output"]
    optimizer_step = OptimizerStep(
        adamw(trainable, lr=1e-4, weight_decay=0.0), trainable, clip_grad_norm=1.0
    )
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
        "tokenize_seconds": setup["tokenize_seconds"],
    }


TRIM_SIDES = ("scored rows", "every row")
"""The trim part's two forwards: the last layer past attention at the scored positions only
(``training.forward``'s default with the chunked output layer), and at every position (the
same forward given the batch without its labels, the loss then picking the scored rows)."""


def trim_worker(args: argparse.Namespace) -> dict:
    """tunelab's forward and backward, the last layer trimmed and not, alternating per batch.

    Each of ``--steps`` batches (after one untimed warm-up of each side) runs both sides, the
    order alternating per batch (ABBA); gradients are dropped after each (no optimizer step:
    both sides see the same weights). Timed: the forward, the loss and the backward.

    Returns:
        ``{side: [{"seconds", "cpu_seconds", "tokens"} per batch]}``.
    """
    from tunelab.losses import CrossEntropyLoss
    from tunelab.training import forward, global_token_count

    setup = _tunelab_setup(args)
    model, output, pad_id = setup["model"], setup["output"], setup["tokenizer"].pad_id
    loss_fn = CrossEntropyLoss()

    def step(batch: dict, side: str) -> dict[str, float]:
        began, began_cpu = time.perf_counter(), time.process_time()
        given = (
            batch if side == TRIM_SIDES[0] else {k: v for k, v in batch.items() if k != "labels"}
        )
        loss_sum, _ = loss_fn(forward(model, given, output), batch["labels"], output=output)
        (loss_sum / global_token_count([batch])).backward()
        model.zero_grad(set_to_none=True)
        return {
            "seconds": time.perf_counter() - began,
            "cpu_seconds": time.process_time() - began_cpu,
            "tokens": int((batch["tokens"] != pad_id).sum()),
        }

    results: dict[str, list[dict[str, float]]] = {side: [] for side in TRIM_SIDES}
    for index, batch in enumerate(setup["loader"]):
        if index > args.steps:
            break
        order = TRIM_SIDES if index % 2 == 0 else TRIM_SIDES[::-1]
        for side in order:
            figures = step(batch, side)
            if index > 0:  # the first batch warms both up
                results[side].append(figures)
    return results


def run_trim(args: argparse.Namespace, data: Path, model_dir: Path, scratch: Path) -> dict:
    """The trim worker in its own process, ``--threads`` threads."""
    result = scratch / "trim.json"
    command = [
        sys.executable, __file__, "--trim-result", str(result), "--data", str(data),
        "--model-dir", str(model_dir), "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
        "--threads", str(args.threads),
    ]  # fmt: skip
    return run_json_worker(command, result, args.threads, "trim")


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
    family = json.loads((Path(args.model_dir) / "config.json").read_text())["model_type"]
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
    parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    if not parts or parts - {"preprocessing", "training", "trim"}:
        raise SystemExit(f"--parts {args.parts!r}: choose from preprocessing, training, trim")
    if args.max_length is None:
        args.max_length = WIDE_MAX_LENGTH if args.model == "wide" else 128
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench_vl_"))
    scratch.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    rows, notes = [], []
    if "preprocessing" in parts:
        preprocessing = run_preprocessing(args, scratch)
        rows, notes = preprocess_rows(preprocessing)
        notes = [
            f"preprocessing: the hub checkpoints' image settings, {args.images} images per "
            f"size, side and round, {args.rounds} round(s), the order alternating, one process "
            f"with {args.threads} thread(s); transformers' processors: "
            f"{preprocessing['classes']}.",
            *notes,
        ]
    if "training" in parts:
        train_rows, train_notes = training_rows(args, scratch)
        rows += train_rows
        notes += train_notes
    if "trim" in parts:
        more_rows, more_notes = trim_rows(args, scratch)
        rows += more_rows
        notes += more_notes
    notes.append(
        f"{os.cpu_count()} cores; load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after."
    )
    print_table(
        "Vision-language: preprocessing vs transformers, LoRA SFT vs TRL SFTTrainer",
        rows,
        notes,
    )


def _rows_and_model(args: argparse.Namespace, scratch: Path) -> tuple[Path, Path]:
    """The chat rows file of the steps, and the model folder of ``--model`` (and ``--layers``)."""
    data = scratch / "vl_chat.jsonl"
    write_rows(data, args.batch_size * (1 + args.steps))
    if args.model == "wide":
        return data, wide_model_dir(args.family, scratch, args.layers)
    return data, family_dir(args.family)


def trim_rows(args: argparse.Namespace, scratch: Path) -> tuple[list[Row], list[str]]:
    """The trim part's rows: tunelab's forward and backward per second and per CPU-second with
    the last layer at the scored positions only, against at every position (no target)."""
    import dataclasses

    data, model_dir = _rows_and_model(args, scratch)
    results = run_trim(args, data, model_dir, scratch)
    ours, theirs = TRIM_SIDES
    shape = shape_label(model_dir)
    figure = (
        f"{args.family} {args.model} ({shape}), LoRA SFT forward + backward with images: "
        f"tokens/s, the last layer past attention at the {ours} / at {theirs}"
    )
    rows, notes = [], []
    for time_key, unit in (("seconds", "tokens/s"), ("cpu_seconds", "tokens per CPU-second")):
        row, row_notes = throughput_row(
            figure.replace("tokens/s", unit), results, 1.0, ours=ours, theirs=theirs,
            time_key=time_key,
        )  # fmt: skip
        rows.append(dataclasses.replace(row, target="-", met=None))
        notes += [f"trim, {note}" for note in row_notes]
    notes.insert(
        0,
        f"trim: one process, {args.threads} intra-op thread(s), {args.steps} batches of "
        f"{args.batch_size} rows after one warm-up; each batch runs both sides, the order "
        "alternating per batch; the forward, the chunked loss and the backward are timed (no "
        "optimizer step); 'rounds' in the notes are batches.",
    )
    return rows, notes


def training_rows(args: argparse.Namespace, scratch: Path) -> tuple[list[Row], list[str]]:
    """The training rounds of ``--model`` (the order alternating), their rows and notes.

    Raises:
        SystemExit: The sides trained different numbers of tokens in a round.
    """
    data, model_dir = _rows_and_model(args, scratch)
    # Each shape's workers in a folder of their own: tunelab's token cache and TRL's output.
    runs = scratch / f"train_{args.model}"
    runs.mkdir(exist_ok=True)
    results = run_trainer_rounds(__file__, args, data, model_dir, runs)
    if "TRL" in results:
        ours = [int(run["tokens"]) for run in results["tunelab"]]
        theirs = [int(run["tokens"]) for run in results["TRL"]]
        if ours != theirs:
            raise SystemExit(
                f"the sides trained different tokens per round (tunelab {ours}, TRL {theirs}): "
                "their rendering of the rows differs, the ratio would mean nothing"
            )
    shape = shape_label(model_dir)
    figure = (
        f"{args.family} {args.model} ({shape}), LoRA SFT with images, 1 process: tokens/s "
        "(tunelab / TRL SFTTrainer)"
    )
    rows, round_notes = throughput_rows(figure, results, TARGET_RATIO)
    tokenize = statistics.median(run["tokenize_seconds"] for run in results["tunelab"])
    where = "random-init, written here" if args.model == "wide" else "embedded"
    notes = [
        f"training: {model_dir.name} ({where}: {shape}), LoRA r=8 on the language model's "
        f"projections, fp32, {args.batch_size} rows a step (in file order), at most "
        f"{args.max_length} tokens a row, {args.steps} timed steps after one warm-up, each with "
        f"its batch's loading; one process per side with {args.threads} intra-op thread(s), "
        f"one side at a time; tunelab's tokenising pass over "
        f"{args.batch_size * (1 + args.steps)} rows before the steps (cached): {tokenize:.2f} s.",
        *round_notes,
    ]
    return rows, notes


def main() -> None:
    """A worker or the orchestrator, by the flags."""
    args = parse_args()
    if args.preprocess_result:
        Path(args.preprocess_result).write_text(json.dumps(preprocess_worker(args)))
        return
    if args.trim_result:
        Path(args.trim_result).write_text(json.dumps(trim_worker(args)))
        return
    workers = {"tunelab": tunelab_worker, "TRL": trl_worker}
    trainer_bench_main(args, workers, orchestrate)


if __name__ == "__main__":
    main()
