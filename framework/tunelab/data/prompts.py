"""Prompt datasets for online RL (GRPO): a prompt per row, and every other column for the rewards.

The prompt is a string (one user message) or a list of chat messages; it is rendered with the
tokenizer's chat template and ``add_generation_prompt`` (``template: auto``), with a named
format for a base model, or encoded as raw text (``template: null``). With the chat template the
messages may carry tool calls, tool results and reasoning, and a row's ``tools`` and
``documents`` are passed to it, as ``chat_dataset`` does (``tunelab.data.conversations``). The
rows stay as read, so a reward can read any column (``answer``, test cases, ...); a prompt
with images adds its images' local files under ``prompt_images`` (``PROMPT_IMAGES``).

Rows are read with the same sources and source options as the SFT and preference datasets
(JSON/JSONL, parquet, csv, Arrow, local folders, the hub; ``data_files``, ``split``,
``skip_malformed``, ``allow_unknown_tokens``), and a malformed row is named as theirs are
(``file:line: row N (0-based), column 'prompt': why``) or skipped and counted. Prompt sets are
small next to SFT corpora and each rank reads and renders them itself; the tokenized cache the
other datasets use is not used here.

For a vision-language model a prompt may hold images as ``image_chat_dataset``'s rows do
(``tunelab.data.image_rows``: content parts, or ``<image>`` placeholders with an ``images``
column), rendered with the tokenizer's chat template and each image's tokens expanded. Every
image is opened and checked when the dataset is built (a bad one is one line with its file and
row, or skipped); its pixels are read when the prompt is sampled
(:meth:`PromptDataset.prompt_images`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tunelab.data.cache import describe_malformed
from tunelab.data.chat import apply_chat_template
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError
from tunelab.data.conversations import check_parts, read_documents, read_part, read_tools
from tunelab.data.image_budget import patches_for_grid
from tunelab.data.image_dataset import image_rows_per_file
from tunelab.data.image_rows import DEFAULT_MAX_IMAGE_PIXELS, ImageChatRows, ImageRef
from tunelab.data.image_sources import ImageFetch, describe, is_url, open_image_source
from tunelab.data.images import ImageError
from tunelab.data.rows import BadRow, read_messages, read_text, to_messages
from tunelab.data.sft import resolve_template
from tunelab.data.sources import JSON_LINE, JSON_PROBLEM, JSON_TEXT, Source, resolve_sources
from tunelab.data.templates import tokenize_messages
from tunelab.data.tokenizer import UNKNOWN_CHECK_SAMPLES, Tokenizer, check_tokens_fit
from tunelab.errors import DataError

__all__ = ["PromptDataset", "padded_collate_prompts", "prompt_dataset"]

PROMPT_IMAGES = "prompt_images"
"""The key of a row with images that lists them for the rewards: each image's local file
(absolute; a URL's or ``data:`` URI's copy in the image cache), in the prompt's order, the
image as read from disk (``PIL.ImageOps.exif_transpose`` turns it upright, as the model saw it)."""


class PromptDataset(Dataset):
    """Rendered prompts and their rows. Item ``i``: ``{"prompt_tokens": [...], "index": i}``.

    Attributes:
        rows: The rows as read (every column), by index; a prompt with images also has
            ``prompt_images`` (``PROMPT_IMAGES``), its images' local files, for the rewards.
        prompts: The rendered prompt texts (what the model sees), by index.
        num_truncated: Prompts cut to ``max_prompt_tokens`` (their start is dropped).
        num_skipped: Malformed rows skipped (``skip_malformed``); not in ``rows``.
        images: Each prompt's images (files and patch grids; empty for a text prompt), or
            None when no prompt has any.
    """

    def __init__(
        self,
        tokens: list[list[int]],
        prompts: list[str],
        rows: list[dict],
        num_truncated: int,
        num_skipped: int = 0,
        images: list[list[ImageRef]] | None = None,
        image_rows: ImageChatRows | None = None,
    ) -> None:
        self.tokens, self.prompts, self.rows = tokens, prompts, rows
        self.num_truncated = num_truncated
        self.num_skipped = num_skipped
        self.images = images
        self._image_rows = image_rows

    def prompt_images(self, index: int) -> dict[str, torch.Tensor] | None:
        """The prompt's images as the model's forward takes them, read now; None: none.

        Returns:
            ``{"pixel_values", "image_grid_thw"}`` (the preprocessing the prompt's tokens were
            counted with).

        Raises:
            DataError: An image file that cannot be read now, or whose patch grid changed.
        """
        refs = self.images[index] if self.images is not None else []
        if not refs:
            return None
        assert self._image_rows is not None and self._image_rows.processing is not None
        pixels, grids = [], []
        for ref in refs:
            try:
                image = open_image_source(ref.path, self._image_rows.max_image_pixels)
                values, grid = patches_for_grid(
                    self._image_rows.processing, image, ref.grid, describe(ref.path)
                )
            except ImageError as error:
                raise DataError(f"prompt {index}: {error}") from None
            pixels.append(values)
            grids.append(list(grid))
        return {
            "pixel_values": torch.cat(pixels),
            "image_grid_thw": torch.tensor(grids, dtype=torch.long),
        }

    def __len__(self) -> int:
        """Number of prompts."""
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """The prompt's token ids and its index (and its images' files and grids, if any)."""
        item: dict[str, Any] = {"prompt_tokens": self.tokens[index], "index": index}
        refs = self.images[index] if self.images is not None else []
        if refs:  # for `tunelab data preview`; the sampler reads the pixels by index
            item["images"] = [ref.path for ref in refs]
            item["image_grids"] = [list(ref.grid) for ref in refs]
        return item


@dataclass
class _Row:
    """A source row and where it comes from (for ``file:line: row N`` errors)."""

    source: str
    line: int | None
    index: int
    value: dict[str, Any] | None
    problem: str | None = None


def _read_rows(sources: list[Source], column: str) -> Iterator[_Row]:
    """Every row of ``sources``, in order; a broken JSON line is a row with its ``problem``.

    Raises:
        DataError: If a source has no ``column`` in any row (a configuration mistake: never
            skipped), or cannot be read.
    """
    for source in sources:
        with tempfile.TemporaryDirectory() as scratch:
            raw = source.read(Path(scratch) / "rows.arrow")
            if raw.has_objects and len(raw.dataset) and column not in raw.columns:
                raise DataError(
                    f"{source.name}: no column {column!r} (columns: "
                    f"{', '.join(raw.columns) or 'none'}); name it with prompt_column"
                )
            for index, record in enumerate(raw.dataset):
                if not raw.json_rows:
                    yield _Row(source.name, None, index, dict(record))
                    continue
                line = record[JSON_LINE]
                if record[JSON_PROBLEM] is not None:
                    yield _Row(source.name, line, index, None, record[JSON_PROBLEM])
                    continue
                value = json.loads(record[JSON_TEXT])
                if isinstance(value, dict):
                    yield _Row(source.name, line, index, value)
                else:
                    problem = f"expected an object, got {type(value).__name__}"
                    yield _Row(source.name, line, index, None, problem)


def prompt_dataset(
    tokenizer: Tokenizer,
    *,
    source: str,
    data_files: Any = None,
    split: str = "train",
    prompt_column: str = "prompt",
    template: str | None = "auto",
    template_kwargs: dict[str, Any] | None = None,
    max_prompt_tokens: int | None = None,
    skip_malformed: bool = False,
    allow_unknown_tokens: bool = False,
    images_column: str = "images",
    image_token: str = "<|image_pad|>",
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_pixels_per_sample: int | None = None,
    **load_dataset_kwargs: Any,
) -> PromptDataset:
    """Prompts to sample completions for, with their rows for the rewards.

    Args:
        tokenizer: The tokenizer (passed by the recipe).
        source: As ``chat_dataset``'s: ``json`` / ``parquet`` / ``csv`` / ``text`` with
            ``data_files``, a local file (its suffix decides) or folder, or a hub dataset id.
        data_files: File path(s) for a loader ``source`` (a string, a list, or a dict of split
            name to paths).
        split: Split to read (from a hub dataset, a folder, or a ``data_files`` dict).
        prompt_column: The column with the prompt: a string (one user message) or a list of
            messages. With a chat template they may carry tool calls, tool results and
            reasoning as ``chat_dataset``'s rows do, and the row's ``tools`` (JSON schemas)
            and ``documents`` columns reach the template; named formats take
            ``{"role", "content"}`` messages only.
        template: ``auto`` (the tokenizer's chat template, with ``add_generation_prompt``), a
            named format for a base model (``chatml``, ``llama3``, ``instruct``, ``alpaca``),
            or None for the raw text (a string prompt, with BOS).
        template_kwargs: Extra variables for the chat template (``auto`` only).
        max_prompt_tokens: Keep only the last this many prompt tokens (None: no cut).
        skip_malformed: Skip malformed rows (counted in ``num_skipped``) instead of raising.
        allow_unknown_tokens: Build even when more than half of the content tokens of the first
            prompts are the tokenizer's unknown or padding token (by default that stops the
            build: the tokenizer does not fit the data).
        images_column: The column of image files for ``<image>`` placeholders in the prompt
            (a vision-language model; image content parts need none), as
            ``image_chat_dataset``'s.
        image_token: The token the chat template writes once per image (Qwen's; Gemma 3's
            preprocessing names its own).
        max_image_pixels: Largest area an image file may declare (a decompression bomb).
        max_pixels_per_sample: Pixels of one row's images together, after resizing: a row
            over it has all its images downscaled by one factor (fewer image tokens), one that
            cannot fit even at the smallest size is malformed (``tunelab.data.image_budget``).
            None: no budget.
        **load_dataset_kwargs: Passed to ``datasets.load_dataset`` (for a JSON file only
            ``field``, read as the other datasets read it).

    Returns:
        The dataset.

    Raises:
        DataError: A missing file or column, a malformed row (``file:line: row N (0-based),
            column: why``, unless ``skip_malformed``), a row the chat template refuses, a chat
            template that overruns its render budget, or a tokenizer that does not fit.
        ConfigError: An unknown template, or ``auto`` with a tokenizer without a template.
    """
    # Settings first: a config mistake is said before any row is read.
    chosen = None if template is None else resolve_template(tokenizer, template, template_kwargs)
    sources = resolve_sources(source, data_files, split, **load_dataset_kwargs)
    tokens, prompts, rows = [], [], []
    images: list[list[ImageRef]] = []
    image_rows: dict[str, ImageChatRows] = {}  # per source file: its folder holds the images

    def with_images(source: str) -> ImageChatRows:
        if source not in image_rows:
            rows_for, _, _ = image_rows_per_file(
                tokenizer,
                "prompt_dataset",
                column=prompt_column,
                images_column=images_column,
                image_token=image_token,
                max_image_pixels=max_image_pixels,
                max_pixels_per_sample=max_pixels_per_sample,
                max_seq_len=max_prompt_tokens or tokenizer.max_seq_len or 2**31 - 1,
                template_kwargs=template_kwargs,
            )
            image_rows[source] = rows_for(source)
        return image_rows[source]

    num_truncated = num_skipped = 0
    for row in _read_rows(sources, prompt_column):
        refs: list[ImageRef] = []
        try:
            if row.value is None:
                raise BadRow("(whole row)", row.problem or "not a row")
            if _has_images(row.value, prompt_column, images_column):
                if not isinstance(chosen, ChatTemplate):
                    raise BadRow(
                        prompt_column,
                        "a prompt with images needs template: auto (the chat template)",
                    )
                ids, refs = with_images(row.source).prompt(row.value)
                if PROMPT_IMAGES in row.value:
                    raise BadRow(
                        PROMPT_IMAGES,
                        "the column name is kept for the prompt's image files, which the "
                        "rewards get in it; rename the column",
                    )
            else:
                ids = _render(tokenizer, chosen, row.value, prompt_column, template_kwargs)
            if refs and max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                raise BadRow(
                    prompt_column,
                    f"the prompt is {len(ids)} tokens with its images; max_prompt_tokens "
                    f"{max_prompt_tokens} would cut them",
                )
        except BadRow as bad:
            if skip_malformed:
                num_skipped += 1
                continue
            message = describe_malformed(row.source, row.line, row.index, bad.column, bad.problem)
            raise DataError(message) from None
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            ids, num_truncated = ids[-max_prompt_tokens:], num_truncated + 1
        tokens.append(ids)
        prompts.append(tokenizer.decode(ids, skip_special_tokens=False))
        if refs:
            fetch = with_images(row.source).fetch
            row.value = {**row.value, PROMPT_IMAGES: [_local_file(ref, fetch) for ref in refs]}
        rows.append(row.value)
        images.append(refs)
    names = ", ".join(source.name for source in sources)
    if not rows:
        skipped = f" ({num_skipped} malformed rows skipped)" if num_skipped else ""
        raise DataError(f"{names}: no usable rows{skipped}")
    if not allow_unknown_tokens:
        check_tokens_fit(tokenizer, tokens[:UNKNOWN_CHECK_SAMPLES], names)
    if not any(images):
        return PromptDataset(tokens, prompts, rows, num_truncated, num_skipped)
    some_rows = next(iter(image_rows.values()))
    return PromptDataset(tokens, prompts, rows, num_truncated, num_skipped, images, some_rows)


def _local_file(ref: ImageRef, fetch: ImageFetch) -> str:
    """An image's file: its absolute path, or for a URL or ``data:`` URI the kept copy."""
    return str(fetch.cached_file(ref.path)) if is_url(ref.path) else os.path.abspath(ref.path)


def _has_images(row: Mapping[str, Any], column: str, images_column: str) -> bool:
    """Whether a prompt row names images (image content parts, or an ``images`` column)."""
    value = row.get(column)
    if row.get(images_column):
        return True
    return isinstance(value, list) and any(
        isinstance(part, Mapping) and (part.get("type") == "image" or "image" in part)
        for message in value
        if isinstance(message, Mapping) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


def _render(
    tokenizer: Tokenizer,
    template: Any,
    row: dict[str, Any],
    column: str,
    template_kwargs: Mapping[str, Any] | None,
) -> list[int]:
    """The prompt's token ids.

    Raises:
        BadRow: If the prompt is missing, empty or malformed, or the template refuses it.
    """
    value = row.get(column)
    if template is None:
        return tokenizer.encode(read_text(row, column), add_bos=True)
    if isinstance(template, ChatTemplate):
        # Messages as chat_dataset reads them (tool calls, tool results, reasoning), with the
        # row's tools and documents: the prompt as the model is served it.
        messages = read_part(value, column, "user")
        tools = read_tools(row, "tools")
        check_parts(messages, len(messages), column, tools=tools)
        try:
            return apply_chat_template(
                tokenizer,
                messages,
                add_generation_prompt=True,
                tools=tools,
                documents=read_documents(row, "documents"),
                template_kwargs=template_kwargs,
                template=template,
            )
        except ChatTemplateError as error:  # the template refuses this row: a malformed row
            raise BadRow(column, str(error)) from None
    pairs = [("user", read_text(row, column))] if isinstance(value, str) else None
    pairs = pairs or read_messages(value, column)
    messages = to_messages(pairs, train_on_input=False)
    ids, _ = tokenize_messages(tokenizer, messages, template, add_generation_prompt=True)
    return ids


def padded_collate_prompts(batch: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompts of a micro-batch, each at the start of its row (padded after: see the engine).

    Returns:
        ``prompt_tokens`` ``[batch, longest]``, ``prompt_lengths`` ``[batch]`` and ``index``
        ``[batch]`` (the dataset index of each prompt).
    """
    width = max(len(item["prompt_tokens"]) for item in batch)
    tokens = torch.full((len(batch), width), pad_id, dtype=torch.long)
    for row, item in enumerate(batch):
        tokens[row, : len(item["prompt_tokens"])] = torch.tensor(item["prompt_tokens"])
    return {
        "prompt_tokens": tokens,
        "prompt_lengths": torch.tensor([len(item["prompt_tokens"]) for item in batch]),
        "index": torch.tensor([item["index"] for item in batch]),
    }
