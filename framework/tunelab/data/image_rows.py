"""Chat rows with images: reading both conventions, checking the images, and tokenising.

Two ways to name a row's images are read:

- transformers' content parts: a message's ``content`` is a list of parts, an image part
  ``{"type": "image", "image": "a.png"}`` or ``{"type": "image", "path": "a.png"}``, a text
  part ``{"type": "text", "text": "..."}``;
- the LLaVA / ShareGPT convention: an ``images`` column lists the files, and each ``<image>``
  in the messages' text stands for the next one.

Relative paths are read from ``image_dir`` (the dataset file's folder); an http(s) URL or a
``data:`` URI is fetched once into the image cache (``tunelab.data.image_sources``). The
conversation is
rendered with the tokenizer's own chat template (which writes one image token per image, e.g.
Qwen2.5-VL's ``<|vision_start|><|image_pad|><|vision_end|>``), and each image token is then
repeated as many times as the image has language tokens, as transformers' processor does.
Gemma 3's processor instead replaces the ``<start_of_image>`` the template writes with the
image's text (``tunelab.data.images_gemma3``) before tokenising: so is it done here, in the
rendered text (``ImagesInText``).
Image tokens are never trained; what is trained is decided by ``tunelab.data.chat`` (the
assistant's text).

Every image is opened and decoded while the rows are tokenised, before any worker starts: a
missing, empty, unreadable or truncated file, one over ``max_image_pixels`` (a decompression
bomb), a placeholder count that does not match the images, and images given to a text-only
model are each a ``BadRow``, which the dataset builders report as one line with the file and
line (``skip_malformed`` skips the row).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tunelab.data.chat import apply_chat_template, tokenize_conversation
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError
from tunelab.data.collate import padded_collate_sft
from tunelab.data.image_budget import budget_processings, patches_for_grid
from tunelab.data.image_sources import ImageFetch, describe, is_url, open_image_source
from tunelab.data.images import ImageError, ImageProcessing
from tunelab.data.images_gemma3 import Gemma3ImageProcessing
from tunelab.data.rows import BadRow, to_sample
from tunelab.data.tokenizer import Tokenizer
from tunelab.data.video_rows import VIDEO_WRAPPER, read_videos, refuse_videos, with_videos
from tunelab.data.videos import VideoProcessing

IMAGE_PLACEHOLDER = "<image>"
"""What stands for the next image of the ``images`` column in a message's text."""
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
"""The largest ``width * height`` an image file may declare (larger: a decompression bomb)."""


@dataclass(frozen=True)
class ImageRef:
    """One image of a sample: its file and its patch grid."""

    path: str
    """The resolved file path, or the URL (``data:`` URI) as the row wrote it."""
    grid: tuple[int, int, int]
    """``(frames, patch rows, patch columns)`` after resizing."""


def _image_part(part: Mapping[str, Any]) -> str | None:
    """The file, URL or ``data:`` URI an image content part names, or None for another part."""
    is_image = part.get("type") == "image" or ("type" not in part and "image" in part)
    if not is_image:
        return None
    for key in ("image", "url", "path"):
        if isinstance(part.get(key), str | os.PathLike):
            return os.fspath(part[key])
    raise ValueError(
        "an image part needs a file path, an http(s) URL or a data: URI under 'image', 'url' "
        "or 'path'"
    )


def read_image_messages(
    messages: Any, column: str, images: Any, images_column: str
) -> tuple[list[dict[str, Any]], list[str]]:
    """A conversation's messages, image parts made plain, and its image files in order.

    Args:
        messages: the row's list of ``{"role", "content"}`` messages.
        column: the column they were read from (for errors).
        images: the row's ``images`` column value, or None.
        images_column: its name (for errors).

    Returns:
        ``(messages, files)``: each message's content a string (no image) or a list of parts
        where every image part is ``{"type": "image"}``; ``files`` as written in the row.

    Raises:
        BadRow: a malformed message or part, both conventions in one row, or a placeholder
            count that differs from the ``images`` column's length.
    """
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise BadRow(column, "expected a list of {'role', 'content'} messages")
    listed = [] if images is None else images
    if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        raise BadRow(images_column, "expected a list of image file paths")
    files: list[str] = []
    placeholders = 0
    result = []
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and listed:
            pieces = content.split(IMAGE_PLACEHOLDER)
            placeholders += len(pieces) - 1
            if len(pieces) > 1:
                parts: list[dict[str, Any]] = []
                for number, piece in enumerate(pieces):
                    if number:
                        parts.append({"type": "image"})
                    if piece:
                        parts.append({"type": "text", "text": piece})
                content = parts
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, Mapping):
                    raise BadRow(column, f"message {index}: a content part must be a mapping")
                try:
                    file = _image_part(part)
                except ValueError as error:
                    raise BadRow(column, f"message {index}: {error}") from None
                if file is None:
                    parts.append(dict(part))
                else:
                    files.append(file)
                    parts.append({"type": "image"})
            content = parts
        result.append({**message, "content": content})
    if files and listed:
        raise BadRow(
            images_column,
            f"the row names images both in content parts and in the {images_column!r} column",
        )
    if listed and placeholders != len(listed):
        raise BadRow(
            images_column,
            f"{placeholders} {IMAGE_PLACEHOLDER} placeholders in the messages but "
            f"{len(listed)} images",
        )
    return result, files or list(listed)


def expand_image_tokens(
    tokens: Sequence[int], mask: Sequence[bool], image_token_id: int, counts: Sequence[int]
) -> tuple[list[int], list[bool]]:
    """Repeat the ``k``-th image token ``counts[k]`` times, masked out of the loss.

    Args:
        tokens: the rendered ids, one image token per image.
        mask: True for tokens left out of the loss.
        image_token_id: the image token.
        counts: language tokens of each image, in order (at least as many as the tokens hold).

    Returns:
        The expanded ``(tokens, mask)``.
    """
    out_tokens: list[int] = []
    out_mask: list[bool] = []
    image = 0
    for token, masked in zip(tokens, mask, strict=True):
        if token == image_token_id:
            out_tokens += [token] * counts[image]
            out_mask += [True] * counts[image]
            image += 1
        else:
            out_tokens.append(token)
            out_mask.append(masked)
    return out_tokens, out_mask


@dataclass
class ImagesInText:
    """A chat template whose renders carry each image's text in place of its placeholder.

    The ``k``-th ``placeholder`` of a render becomes ``texts[k]`` (Gemma 3's processor, which
    replaces text before tokenising); generation-block spans move with the text. Everything
    else is the wrapped template's.
    """

    template: ChatTemplate
    placeholder: str
    texts: Sequence[str]

    def __getattr__(self, name: str) -> Any:
        if name == "template":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.template, name)

    def render(self, messages: Sequence[Any], **options: Any) -> str:
        """``ChatTemplate.render`` with the images' text."""
        return self.render_with_spans(messages, **options)[0]

    def render_with_spans(
        self, messages: Sequence[Any], **options: Any
    ) -> tuple[str, list[tuple[int, int]]]:
        """``ChatTemplate.render_with_spans`` with the images' text.

        Raises:
            ChatTemplateError: the render holds more placeholders than there are images.
        """
        text, spans = self.template.render_with_spans(messages, **options)
        pieces = text.split(self.placeholder)
        if len(pieces) - 1 > len(self.texts):
            raise ChatTemplateError(
                f"the chat template wrote {len(pieces) - 1} {self.placeholder} for "
                f"{len(self.texts)} images"
            )
        # Where each placeholder ended in the render, and how much longer the text is after it.
        ends, shifts, position, shift = [], [], 0, 0
        for piece, image_text in zip(pieces[:-1], self.texts, strict=False):
            position += len(piece) + len(self.placeholder)
            shift += len(image_text) - len(self.placeholder)
            ends.append(position)
            shifts.append(shift)

        def moved(offset: int) -> int:
            passed = [s for end, s in zip(ends, shifts, strict=True) if end <= offset]
            return offset + (passed[-1] if passed else 0)

        out = [piece + text for piece, text in zip(pieces[:-1], self.texts, strict=False)]
        return "".join(out) + pieces[-1], [(moved(lo), moved(hi)) for lo, hi in spans]


@dataclass
class ImageChatRows:
    """Row function of a chat dataset whose rows may hold images.

    Each sample is ``{"tokens", "labels", "truncated", "images", "image_grids"}`` with
    ``images`` the files of the images the sample holds and ``image_grids`` their grids.
    """

    tokenizer: Tokenizer
    template: ChatTemplate
    column: str
    processing: ImageProcessing | Gemma3ImageProcessing | None
    """How images become patches; None for a text-only model (rows with images are refused)."""
    image_token: str = "<|image_pad|>"
    """The token the chat template writes once per image (Qwen; Gemma 3's processing names
    its own tokens)."""
    image_dir: str | None = None
    """Folder relative image paths are read from (None: the working directory)."""
    images_column: str = "images"
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_seq_len: int | None = None
    template_kwargs: Mapping[str, Any] | None = None
    train_on_reasoning: bool = True
    videos: VideoProcessing | None = None
    """How videos become patches; None for a model without video input (rows with videos are
    refused; ``tunelab.data.video_rows``)."""
    fetch: ImageFetch = ImageFetch()
    """How images named by URL are fetched (each is fetched here, once, and kept)."""
    max_pixels_per_sample: int | None = None
    """The pixels of a row's images together after resizing; a row over it is downscaled
    (``tunelab.data.image_budget``). None: no budget."""

    def _images(self, files: list[str]) -> list[tuple[ImageRef, int]]:
        """Each image checked, with its grid and token count (the pixel budget applied)."""
        opened = []
        for file in files:
            path = Path(file)
            if not path.is_absolute() and self.image_dir is not None:
                path = Path(self.image_dir) / path
            source = file if is_url(file) else str(path)  # a URL is kept as written
            try:
                image = open_image_source(source, self.max_image_pixels, self.fetch)
                assert self.processing is not None
                self.processing.grid(image.height, image.width)  # an empty or too thin image
            except ImageError as error:
                raise BadRow(self.images_column, str(error)) from None
            opened.append((source, image.height, image.width))
        if not opened:
            return []
        assert self.processing is not None
        sizes = [(height, width) for _, height, width in opened]
        try:
            chosen = budget_processings(self.processing, sizes, self.max_pixels_per_sample)
        except ImageError as error:
            raise BadRow(self.images_column, str(error)) from None
        return [
            (ImageRef(source, each.grid(height, width)), each.num_tokens(height, width))
            for each, (source, height, width) in zip(chosen, opened, strict=True)
        ]

    def _read(self, messages: Any, row: Mapping[str, Any]) -> tuple[list, list, Any, bool]:
        """The row read: ``(messages, images, template, in_text)``; raises ``BadRow``.

        The messages with plain image parts, each image checked with its token count, the
        template that renders them, and whether the images' tokens come in the text (Gemma 3).
        """
        messages, files = read_image_messages(
            messages, self.column, row.get(self.images_column), self.images_column
        )
        if files and self.processing is None:
            raise BadRow(
                self.images_column,
                "the row has images but the model is text-only (no vision tower)",
            )
        images = self._images(files)
        template: Any = self.template
        in_text = isinstance(self.processing, Gemma3ImageProcessing)
        if in_text:
            texts = [self.processing.image_text(image.grid[0] - 1) for image, _ in images]
            template = ImagesInText(self.template, self.processing.placeholder, texts)
        return messages, images, template, in_text

    def prompt(self, row: Mapping[str, Any]) -> tuple[list[int], list[ImageRef]]:
        """A generation prompt (GRPO): the row's messages and the assistant's opening.

        The column holds a string (one user message, ``<image>`` placeholders for the
        ``images`` column) or messages; each image's tokens are expanded as in a chat row.

        Returns:
            ``(ids, images)``.

        Raises:
            BadRow: a malformed row or image, or image tokens that do not match the images.
        """
        value = row.get(self.column)
        if isinstance(value, str):
            value = [{"role": "user", "content": value}]
        messages, images, template, in_text = self._read(value, row)
        refuse_videos(messages, self.column)
        try:
            ids = apply_chat_template(
                self.tokenizer,
                messages,
                add_generation_prompt=True,
                template_kwargs=self.template_kwargs,
                template=template,
            )
        except ChatTemplateError as error:
            raise BadRow(self.column, str(error)) from None
        counts = [count for _, count in images]
        token = self.processing.image_token if in_text else self.image_token
        image_token_id = self.tokenizer.token_to_id(token)
        held = ids.count(image_token_id) if image_token_id is not None else 0
        # Qwen's template writes one image token per image; Gemma 3's text holds them all.
        expected = sum(counts) if in_text else len(images)
        if held != expected:
            raise BadRow(
                self.column,
                f"the chat template wrote {held} {token} tokens for {len(images)} images "
                f"({expected} expected)",
            )
        if not in_text and images:
            ids, _ = expand_image_tokens(ids, [True] * len(ids), image_token_id, counts)
        return ids, [image for image, _ in images]

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Samples of one row; raises ``BadRow``."""
        messages, images, template, in_text = self._read(row.get(self.column), row)
        messages, videos = read_videos(
            messages, self.column, self.videos, self.image_dir, self.max_image_pixels
        )
        if videos:  # the processor's text for each video, in place of the template's
            template = ImagesInText(template, VIDEO_WRAPPER, [video.text for video in videos])
        try:
            rendered = tokenize_conversation(
                self.tokenizer,
                messages,
                train_on_reasoning=self.train_on_reasoning,
                template_kwargs=self.template_kwargs,
                template=template,
            )
        except ChatTemplateError as error:
            raise BadRow(self.column, str(error)) from None
        if in_text:
            return with_videos(
                [(_image_tokens_sample(self, t, m, images), t) for t, m in rendered], videos, self
            )
        image_token_id = self.tokenizer.token_to_id(self.image_token)
        samples = []
        for tokens, mask in rendered:
            held = tokens.count(image_token_id) if image_token_id is not None else 0
            if held > len(images) or (images and image_token_id is None):
                raise BadRow(
                    self.column,
                    f"the chat template wrote {held} {self.image_token} tokens for "
                    f"{len(images)} images",
                )
            tokens, mask = expand_image_tokens(
                tokens, mask, image_token_id, [count for _, count in images[:held]]
            )
            samples.append(
                (_image_sample(self, tokens, mask, image_token_id, images[:held]), tokens)
            )
        return with_videos(samples, videos, self)


def _image_tokens_sample(
    rows: ImageChatRows, tokens: list[int], mask: list[bool], images: list
) -> dict[str, Any]:
    """A sample of ids whose images are already in the text (Gemma 3), image tokens untrained."""
    assert isinstance(rows.processing, Gemma3ImageProcessing)
    image_token_id = rows.tokenizer.token_to_id(rows.processing.image_token)
    held = tokens.count(image_token_id) if image_token_id is not None else 0
    number = _counted_images(held, [count for _, count in images])
    if number is None or (images and image_token_id is None):
        raise BadRow(
            rows.column,
            f"the sample holds {held} {rows.processing.image_token} tokens, which no leading "
            f"images of the row add up to ({[count for _, count in images]} each)",
        )
    mask = [masked or token == image_token_id for token, masked in zip(tokens, mask, strict=True)]
    return _image_sample(rows, tokens, mask, image_token_id, images[:number])


def _image_sample(
    rows: ImageChatRows, tokens: list[int], mask: list[bool], image_token_id: int, images: list
) -> dict[str, Any]:
    """The sample of expanded ids holding ``images``; a cut inside an image is a ``BadRow``."""
    sample, cut = to_sample(tokens, mask, rows.max_seq_len)
    if cut and image_token_id in tokens[rows.max_seq_len :]:
        raise BadRow(
            rows.column,
            f"the sample is {len(tokens)} tokens with its images; max_seq_len "
            f"{rows.max_seq_len} would cut an image",
        )
    return {
        **sample,
        "truncated": cut,
        "images": [image.path for image, _ in images],
        "image_grids": [list(image.grid) for image, _ in images],
    }


def _counted_images(held: int, counts: Sequence[int]) -> int | None:
    """How many leading images hold exactly ``held`` image tokens, or None if none do."""
    total = 0
    for number, count in enumerate(counts):
        if total == held:
            return number
        total += count
    return len(counts) if total == held else None


def padded_collate_images(
    batch: list[dict[str, Any]],
    pad_id: int,
    processing: ImageProcessing | Gemma3ImageProcessing,
    ignore_index: int = -100,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> dict[str, torch.Tensor]:
    """``padded_collate_sft``, plus the batch's images read and cut into patches.

    Images are read here, in the data loader (its worker processes with
    ``schedule.dataloader_workers``), not when the rows were tokenised (an
    image named by URL from the image cache, fetched again if it is no longer there).

    Args:
        batch: ``ImageChatRows`` samples (``images`` and ``image_grids`` beside the tokens),
            or packs of them (``input_pos`` and ``document_ids`` too, images in token order).
        pad_id: token id of padding.
        processing: how images become patches (the one the rows were tokenised with).
        ignore_index: label of padding.
        max_image_pixels: the pixel limit (checked again: a file may change after the check).

    Returns:
        ``padded_collate_sft``'s tensors, and when any item has images ``pixel_values``
        ``[patches, features]`` and ``image_grid_thw`` ``[images, 3]``, row after row.

    Raises:
        ImageError: an image that cannot be read, or whose grid differs from the one its tokens
            were counted for (the file changed since).
    """
    # Packs keep their input_pos and document_ids; the images are read below.
    files = ("images", "image_grids")
    out = padded_collate_sft(
        [{key: value for key, value in item.items() if key not in files} for item in batch],
        pad_id,
        ignore_index,
    )
    pixels, grids = [], []
    for item in batch:
        for path, expected in zip(item.get("images") or [], item.get("image_grids") or []):
            image = open_image_source(path, max_image_pixels)
            values, grid = patches_for_grid(processing, image, expected, describe(path))
            pixels.append(values)
            grids.append(grid)
    if pixels:
        out["pixel_values"] = torch.cat(pixels)
        out["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
    return out
