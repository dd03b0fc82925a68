"""Chat rows with images: reading both conventions, checking the images, and tokenising.

Two ways to name a row's images are read:

- transformers' content parts: a message's ``content`` is a list of parts, an image part
  ``{"type": "image", "image": "a.png"}`` or ``{"type": "image", "path": "a.png"}``, a text
  part ``{"type": "text", "text": "..."}``;
- the LLaVA / ShareGPT convention: an ``images`` column lists the files, and each ``<image>``
  in the messages' text stands for the next one.

Relative paths are read from ``image_dir`` (the dataset file's folder). The conversation is
rendered with the tokenizer's own chat template (which writes one image token per image, e.g.
Qwen2.5-VL's ``<|vision_start|><|image_pad|><|vision_end|>``), and each image token is then
repeated as many times as the image has language tokens, as transformers' processor does.
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

from tunelab.data.chat import tokenize_conversation
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError
from tunelab.data.collate import padded_collate_sft
from tunelab.data.images import ImageError, ImageProcessing, open_image
from tunelab.data.rows import BadRow, to_sample
from tunelab.data.tokenizer import Tokenizer

IMAGE_PLACEHOLDER = "<image>"
"""What stands for the next image of the ``images`` column in a message's text."""
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
"""The largest ``width * height`` an image file may declare (larger: a decompression bomb)."""


@dataclass(frozen=True)
class ImageRef:
    """One image of a sample: its file and its patch grid."""

    path: str
    """The resolved file path."""
    grid: tuple[int, int, int]
    """``(frames, patch rows, patch columns)`` after resizing."""


def _image_part(part: Mapping[str, Any]) -> str | None:
    """The file an image content part names, or None for another part."""
    is_image = part.get("type") == "image" or ("type" not in part and "image" in part)
    if not is_image:
        return None
    for key in ("image", "path"):
        if isinstance(part.get(key), str | os.PathLike):
            return os.fspath(part[key])
    raise ValueError(
        "an image part needs a file path under 'image' or 'path' (URLs and inline images are "
        "not read: save them as files)"
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
class ImageChatRows:
    """Row function of a chat dataset whose rows may hold images.

    Each sample is ``{"tokens", "labels", "truncated", "images", "image_grids"}`` with
    ``images`` the files of the images the sample holds and ``image_grids`` their grids.
    """

    tokenizer: Tokenizer
    template: ChatTemplate
    column: str
    processing: ImageProcessing | None
    """How images become patches; None for a text-only model (rows with images are refused)."""
    image_token: str = "<|image_pad|>"
    """The token the chat template writes once per image."""
    image_dir: str | None = None
    """Folder relative image paths are read from (None: the working directory)."""
    images_column: str = "images"
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_seq_len: int | None = None
    template_kwargs: Mapping[str, Any] | None = None
    train_on_reasoning: bool = True

    def _image(self, file: str) -> tuple[ImageRef, int]:
        path = Path(file)
        if not path.is_absolute() and self.image_dir is not None:
            path = Path(self.image_dir) / path
        try:
            image = open_image(path, self.max_image_pixels)
            assert self.processing is not None
            height, width = self.processing.resized_size(image.height, image.width)
        except ImageError as error:
            raise BadRow(self.images_column, str(error)) from None
        factor = self.processing.patch_size
        grid = (1, height // factor, width // factor)
        return ImageRef(str(path), grid), self.processing.num_tokens(image.height, image.width)

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Samples of one row; raises ``BadRow``."""
        messages, files = read_image_messages(
            row.get(self.column), self.column, row.get(self.images_column), self.images_column
        )
        if files and self.processing is None:
            raise BadRow(
                self.images_column,
                "the row has images but the model is text-only (no vision tower)",
            )
        images = [self._image(file) for file in files]
        try:
            rendered = tokenize_conversation(
                self.tokenizer,
                messages,
                train_on_reasoning=self.train_on_reasoning,
                template_kwargs=self.template_kwargs,
                template=self.template,
            )
        except ChatTemplateError as error:
            raise BadRow(self.column, str(error)) from None
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
            sample, cut = to_sample(tokens, mask, self.max_seq_len)
            if cut and image_token_id in tokens[self.max_seq_len :]:
                raise BadRow(
                    self.column,
                    f"the sample is {len(tokens)} tokens with its images; max_seq_len "
                    f"{self.max_seq_len} would cut an image",
                )
            samples.append(
                {
                    **sample,
                    "truncated": cut,
                    "images": [image.path for image, _ in images[:held]],
                    "image_grids": [list(image.grid) for image, _ in images[:held]],
                }
            )
        return samples


def padded_collate_images(
    batch: list[dict[str, Any]],
    pad_id: int,
    processing: ImageProcessing,
    ignore_index: int = -100,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> dict[str, torch.Tensor]:
    """``padded_collate_sft``, plus the batch's images read and cut into patches.

    Images are read here, in the data loader's workers, not when the rows were tokenised.

    Args:
        batch: ``ImageChatRows`` samples (``images`` and ``image_grids`` beside the tokens).
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
    out = padded_collate_sft(
        [{"tokens": item["tokens"], "labels": item["labels"]} for item in batch],
        pad_id,
        ignore_index,
    )
    pixels, grids = [], []
    for item in batch:
        for path, expected in zip(item.get("images") or [], item.get("image_grids") or []):
            values, grid = processing(open_image(path, max_image_pixels))
            if list(grid) != list(expected):
                raise ImageError(
                    f"{path}: the image is now {list(grid)} patches, not the {list(expected)} "
                    "its tokens were counted for (the file changed after tokenising)"
                )
            pixels.append(values)
            grids.append(grid)
    if pixels:
        out["pixel_values"] = torch.cat(pixels)
        out["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
    return out
