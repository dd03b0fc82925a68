"""``tunelab data preview``: what a run would train on, without a model or a process group.

The config is validated against its recipe and its ``tokenizer`` and ``dataset`` components
are built exactly as the recipes build them (``instantiate(args.tokenizer)``, then
``instantiate(args.dataset, tokenizer=tokenizer)``), so the preview is the recipe's data, not a
re-implementation of it.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import re
import sys
from collections.abc import Iterator
from itertools import islice
from typing import Any, TextIO

from tunelab.cli._check import load_recipe_config, recipe_of_config
from tunelab.cli._discovery import load_recipe_args
from tunelab.config import instantiate, parse_args
from tunelab.config._instantiate import import_component
from tunelab.errors import ConfigError

IGNORE_INDEX = -100  # tunelab.data.IGNORE_INDEX, without importing torch to parse arguments
_TRAINED_START, _TRAINED_END = "\x1b[1;32m", "\x1b[0m"  # bold green on a terminal
_MARKER_START, _MARKER_END = "[[", "]]"


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return number


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the ``data`` subcommand and its ``preview`` action."""
    parser = subparsers.add_parser(
        "data",
        parents=[parent],
        help="inspect the data a config trains on",
        description="Inspect the data a config trains on.",
    )
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    preview = actions.add_parser(
        "preview",
        parents=[parent],
        help="show the first rows as the recipe tokenizes them, trained tokens marked",
        description="Build the config's tokenizer and dataset exactly as its recipe does (no "
        "model, no process group) and show the first items: the text with the trained tokens "
        "highlighted (bold green on a terminal, [[...]] otherwise), or with --json one JSON "
        'object per item, {"input_ids": [...], "labels": [...]} with labels -100 where not '
        "trained (preference items: chosen_input_ids, chosen_labels, rejected_input_ids, "
        "rejected_labels). Items with images list each image: its file, size, resized size, "
        "patch grid, token count and the positions its tokens take (with --json also the "
        "shape and sha256 of its pixel values as the training collate makes them).",
    )
    preview.add_argument("config", metavar="CONFIG", help="built-in config name or YAML path")
    preview.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="key=value or ~key")
    preview.add_argument(
        "--rows", type=_positive, default=3, metavar="N", help="items to show (default 3)"
    )
    preview.add_argument("--json", action="store_true", help="one JSON object per item")


def _layout_line(tokenizer: Any, node: Any) -> str | None:
    """How the dataset's chat template lays out conversations, when it renders with one."""
    from tunelab.data.chat import describe_layout  # here: tunelab.data imports torch

    if tokenizer.chat_template is None or node is None or "_component_" not in node:
        return None
    builder = import_component(node["_component_"])
    default = inspect.signature(builder).parameters.get("template")
    template = node.get("template", default.default if default is not None else None)
    if template != "auto":
        return None
    kwargs = node.get("template_kwargs")
    return describe_layout(tokenizer, dict(kwargs) if kwargs else None)


def build_dataset(config: str, overrides: list[str]) -> tuple[Any, Any]:
    """Build a config's tokenizer and training dataset the way its recipe does.

    Args:
        config: A built-in config name or a YAML path.
        overrides: ``key=value`` / ``~key`` strings.

    Returns:
        ``(tokenizer, dataset)``.

    Raises:
        TunelabError: If the config does not validate against its recipe or has no dataset.
    """
    return _build(config, overrides)[:2]


def _build(config: str, overrides: list[str]) -> tuple[Any, Any, Any, Any]:
    """``build_dataset``'s tokenizer and dataset, the dataset's config node, and the settings."""
    cfg, config_path, recipe_path = load_recipe_config(config, overrides)
    args = parse_args(cfg, load_recipe_args(recipe_path or recipe_of_config(cfg, config_path)))
    if getattr(args, "dataset", None) is None or getattr(args, "tokenizer", None) is None:
        raise ConfigError(f"config {config_path} has no dataset to preview")
    tokenizer = instantiate(args.tokenizer)
    return tokenizer, instantiate(args.dataset, tokenizer=tokenizer), args.dataset, args


def _episode_prompts(tokenizer: Any, dataset: Any, agentic: Any, rows: int) -> Iterator[str]:
    """What agentic episodes start from: each row's prompt with the tools offered.

    Rendered as ``EpisodeRunner`` renders it (``episode_prompt``: the environment reset with
    seed 0, its text added, the tools' schemas in the template), trained tokens none.
    """
    from tunelab.data.conversations import read_part  # here: tunelab.data imports torch
    from tunelab.rl.agentic import Toolbox, episode_prompt

    toolbox = Toolbox.from_nodes(agentic.tools, agentic.environments)
    for index in range(min(rows, len(dataset.rows))):
        row = dataset.rows[index]
        messages = read_part(row.get(agentic.prompt_column), agentic.prompt_column, "user")
        _, tools, text = episode_prompt(
            tokenizer.chat_template, toolbox, messages, row, 0, agentic.template_kwargs
        )
        names = ", ".join(tools.tools) or "none"
        where = f"; environment {tools.environment_name}" if tools.environment_name else ""
        count = len(tokenizer.encode(text, add_bos=False))
        yield f"\n--- episode {index}: {count} prompt tokens; tools: {names}{where} ---\n{text}\n"


def _sequences(item: dict[str, Any]) -> Iterator[tuple[str, list[int], list[int]]]:
    """``(name, input_ids, labels)`` of an SFT item (name ""), of each side of a pair, or a prompt."""
    if "tokens" in item:
        yield "", list(item["tokens"]), list(item["labels"])
    elif "prompt_tokens" in item:  # a GRPO prompt: what generation starts from, nothing trained
        yield "prompt", list(item["prompt_tokens"]), [IGNORE_INDEX] * len(item["prompt_tokens"])
    else:
        for side in ("chosen", "rejected"):
            yield side, list(item[f"{side}_tokens"]), list(item[f"{side}_labels"])


def _highlighted(tokenizer: Any, ids: list[int], labels: list[int], color: bool) -> str:
    """The decoded ids, each run of trained tokens wrapped in markers (or colour)."""
    start, end = (_TRAINED_START, _TRAINED_END) if color else (_MARKER_START, _MARKER_END)
    pieces = []
    run: list[int] = []
    run_trained = False
    for token, label in [*zip(ids, labels), (None, None)]:
        trained = label is not None and label != IGNORE_INDEX
        if run and (token is None or trained != run_trained):
            text = tokenizer.decode(run, skip_special_tokens=False)
            pieces.append(f"{start}{text}{end}" if run_trained else text)
            run = []
        if token is not None:
            run.append(token)
            run_trained = trained
    return "".join(pieces)


def _image_token(tokenizer: Any, node: Any) -> str:
    """The token an image dataset's items repeat once per image token.

    The model's own when its preprocessing names one (Gemma 3's ``<image_soft_token>``), else
    the dataset's ``image_token`` (Qwen's ``<|image_pad|>``).
    """
    from tunelab.data.image_dataset import image_processing_for  # here: imports torch

    own = getattr(image_processing_for(tokenizer), "image_token", None)
    if own is not None:
        return own
    builder = import_component(node["_component_"])
    default = inspect.signature(builder).parameters.get("image_token")
    return node.get("image_token", default.default if default is not None else "<|image_pad|>")


def _image_records(tokenizer: Any, node: Any, item: dict[str, Any], pixels: bool) -> list[dict]:
    """Each image of an item: file, sizes, grid, token count and span (and its pixel values).

    The k-th run of image tokens in the item is the k-th image's (Gemma 3: an image with
    pan-and-scan crops is as many runs as its grid's first entry, its pieces). With ``pixels``
    each image is read and cut into patches as the training collate does (``ImageProcessing``),
    and the record gets the pixel values' shape and the sha256 of their float32 bytes.
    """
    from tunelab.data.image_budget import patches_for_grid  # here: imports torch
    from tunelab.data.image_dataset import image_processing_for
    from tunelab.data.image_rows import DEFAULT_MAX_IMAGE_PIXELS
    from tunelab.data.image_sources import open_image_source

    processing = image_processing_for(tokenizer)
    token_id = tokenizer.token_to_id(_image_token(tokenizer, node))
    tokens = list(item["tokens"] if "tokens" in item else item["prompt_tokens"])  # or a prompt's
    spans = []
    for position, token in enumerate(tokens):
        if token == token_id and (position == 0 or tokens[position - 1] != token_id):
            spans.append([position, position])
        if token == token_id:
            spans[-1][1] = position + 1
    records = []
    pieces = hasattr(processing, "image_token")  # Gemma 3: a run per image and crop
    for path, grid in zip(item["images"], item["image_grids"]):
        runs, spans = spans[: grid[0] if pieces else 1], spans[grid[0] if pieces else 1 :]
        if not runs:
            break
        image = open_image_source(path, node.get("max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS))
        frames, rows, columns = grid
        record = {
            "path": path,
            "size": [image.width, image.height],
            "resized": [columns * processing.patch_size, rows * processing.patch_size]
            if not pieces
            else [processing.image_size] * 2,
            "grid": list(grid),
            "tokens": sum(end - start for start, end in runs),
            "token_start": runs[0][0],
            "token_end": runs[-1][1],
        }
        if pixels:
            values, _ = patches_for_grid(processing, image, grid, path)
            data = values.float().contiguous().numpy().tobytes()
            record["pixel_values_shape"] = list(values.shape)
            record["pixel_values_sha256"] = hashlib.sha256(data).hexdigest()
        records.append(record)
    return records


def _video_records(tokenizer: Any, node: Any, item: dict[str, Any], pixels: bool) -> list[dict]:
    """Each video of an item (``tunelab.data.video_rows.video_records``)."""
    from tunelab.data.image_rows import DEFAULT_MAX_IMAGE_PIXELS  # here: imports torch
    from tunelab.data.video_rows import video_processing_for, video_records

    limit = node.get("max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS)
    return video_records(tokenizer, item, video_processing_for(tokenizer), limit, pixels)


def _image_lines(records: list[dict]) -> str:
    return "".join(
        f"  image {index}: {record['path']} {record['size'][0]}x{record['size'][1]}, resized "
        f"{record['resized'][0]}x{record['resized'][1]}, grid "
        f"{'x'.join(map(str, record['grid']))}: {record['tokens']} tokens at positions "
        f"{record['token_start']}-{record['token_end'] - 1}\n"
        for index, record in enumerate(records)
    )


def _collapse_runs(text: str, token: str) -> str:
    """Each run of ``token`` (an image's tokens) written once with its length: ``<t>x16``."""
    return re.sub(
        f"(?:{re.escape(token)}){{2,}}", lambda run: f"{token}x{len(run[0]) // len(token)}", text
    )


def _first_items(dataset: Any, rows: int) -> list[dict[str, Any]]:
    """The first ``rows`` items: by index, or a stream's first (epoch 0, seed 0)."""
    from tunelab.data.streaming import StreamingDataset, start_location

    if isinstance(dataset, StreamingDataset):
        return [item for item, _ in islice(dataset.items(0, 0, start_location()), rows)]
    return [dataset[index] for index in range(min(rows, len(dataset)))]


def _summary(config: str, dataset: Any) -> str:
    counts = [
        f"{getattr(dataset, name, 0)} {name.removeprefix('num_')}"
        for name in ("num_skipped", "num_truncated", "num_dropped")
        if getattr(dataset, name, 0)
    ]
    kind = "packs" if getattr(dataset, "packed", False) else "items"
    extra = f" ({', '.join(counts)})" if counts else ""
    if not hasattr(dataset, "__len__"):  # a stream: its length is unknown
        return f"{config}: a stream of {len(dataset.sources)} files ({kind} of epoch 0, seed 0)"
    return f"{config}: {len(dataset)} {kind}{extra}"


def preview(
    config: str, overrides: list[str], rows: int, as_json: bool, out: TextIO | None = None
) -> None:
    """Print the first ``rows`` items of a config's dataset.

    Args:
        config: A built-in config name or a YAML path.
        overrides: ``key=value`` / ``~key`` strings.
        rows: How many items.
        as_json: One JSON object per item instead of highlighted text.
        out: Where to print (standard output by default).
    """
    out = out or sys.stdout
    tokenizer, dataset, node, args = _build(config, overrides)
    agentic = getattr(args, "agentic", None)
    if agentic is not None and not as_json:  # episodes start from the rows with the tools
        out.write(_summary(config, dataset) + " (agentic episodes: prompts with their tools)\n")
        for text in _episode_prompts(tokenizer, dataset, agentic, rows):
            out.write(text)
        return
    items = _first_items(dataset, rows)
    if as_json:
        for item in items:
            record = {}
            for side, ids, labels in _sequences(item):
                prefix = f"{side}_" if side else ""
                record[f"{prefix}input_ids"], record[f"{prefix}labels"] = ids, labels
            if item.get("images"):
                record["images"] = _image_records(tokenizer, node, item, pixels=True)
            if item.get("videos"):
                record["videos"] = _video_records(tokenizer, node, item, pixels=True)
            out.write(json.dumps(record) + "\n")
        return
    color = out.isatty() and "NO_COLOR" not in os.environ
    out.write(_summary(config, dataset) + "\n")
    layout = _layout_line(tokenizer, node)
    if layout:
        out.write(layout + "\n")
    for index, item in enumerate(items):
        for side, ids, labels in _sequences(item):
            num_trained = sum(label != IGNORE_INDEX for label in labels)
            name = f"item {index}{f' {side}' if side else ''}"
            out.write(f"\n--- {name}: {len(ids)} tokens, {num_trained} trained ---\n")
            text = _highlighted(tokenizer, ids, labels, color)
            if item.get("images"):
                out.write(_image_lines(_image_records(tokenizer, node, item, pixels=False)))
                text = _collapse_runs(text, _image_token(tokenizer, node))
            if item.get("videos"):
                from tunelab.data.video_rows import VIDEO_PAD, video_lines

                out.write(video_lines(_video_records(tokenizer, node, item, pixels=False)))
                text = _collapse_runs(text, VIDEO_PAD)
            out.write(text + "\n")


def run(namespace: argparse.Namespace) -> int:
    """Run ``tunelab data ACTION``.

    Returns:
        The exit code, 0 (problems raise ``TunelabError``).
    """
    try:
        preview(namespace.config, namespace.overrides, namespace.rows, namespace.json)
    except BrokenPipeError:
        # The reader stopped early (`| head`): not an error. Point stdout at /dev/null so the
        # interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
