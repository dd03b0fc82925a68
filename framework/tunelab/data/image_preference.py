"""Preference pairs whose prompt holds images, for DPO on a vision-language model.

A row is ``{"prompt", "chosen", "rejected"}`` as ``preference_dataset`` reads it (a string is
one user message, an answer string one assistant message), where the prompt names its images
as a chat row does (``tunelab.data.image_rows``): content parts, or ``<image>`` placeholders
with an ``images`` column. Both answers share the prompt's images: each side is the chat row
``prompt + answer`` rendered by the tokenizer's own template with those images, so its ids
equal the chat-row path's (image tokens repeated per image, never trained), and only the
answer is trained. The answers themselves hold no image, and the prompt no assistant turn
(which the chat path would train); either is a malformed row.

The collate (:func:`preference_collate`) lays a batch out as ``padded_collate_dpo`` does, chosen
rows then rejected rows, with every row's pixels in that order: each image is preprocessed
and run through the tower once per side.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tunelab.data.collate import padded_collate_dpo
from tunelab.data.image_dataset import image_processing_for, image_rows_per_file
from tunelab.data.image_rows import DEFAULT_MAX_IMAGE_PIXELS, ImageChatRows, padded_collate_images
from tunelab.data.rows import IGNORE_INDEX, BadRow, resolve_columns
from tunelab.data.sources import resolve_sources
from tunelab.data.tokenized import TokenizedDataset, build_tokenized
from tunelab.data.tokenizer import Tokenizer

SIDES = ("chosen", "rejected")


def _messages(value: Any, column: str, role: str) -> list[dict[str, Any]]:
    """A column's messages: a string is one message of ``role``, a list is taken as is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, Mapping) for m in value):
        return [dict(message) for message in value]
    raise BadRow(column, "expected a string or a non-empty list of {'role', 'content'} messages")


def _has_image(message: Mapping[str, Any]) -> bool:
    content = message.get("content")
    if isinstance(content, str):
        return "<image>" in content
    return isinstance(content, list) and any(
        isinstance(part, Mapping) and (part.get("type") == "image" or "image" in part)
        for part in content
    )


@dataclass
class ImagePreferenceRows:
    """Row function of ``image_preference_dataset``: one pair, both sides with the prompt's images.

    Items are ``preference_dataset``'s (``chosen_tokens`` ... ``rejected_labels``,
    ``truncated``, ``completion``) plus the prompt's ``images`` and ``image_grids``.
    """

    chat: ImageChatRows
    """Renders ``prompt + answer`` with the images; its ``column`` is the prompt column."""
    columns: dict[str, str]
    """Our column name (``prompt``, ``chosen``, ``rejected``) to the file's."""

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The pair's item; raises ``BadRow``."""
        prompt_column = self.columns["prompt"]
        prompt = _messages(row.get(prompt_column), prompt_column, "user")
        if any(message.get("role") == "assistant" for message in prompt):
            raise BadRow(
                prompt_column,
                "a prompt with images may not hold assistant turns yet (the answers are the "
                "pair's only assistant turns)",
            )
        images = row.get(self.chat.images_column)
        item: dict[str, Any] = {"truncated": False, "completion": True}
        for side in SIDES:
            column = self.columns[side]
            answer = _messages(row.get(column), column, "assistant")
            if any(_has_image(message) for message in answer):
                raise BadRow(column, "an answer may not hold images: only the prompt's are shared")
            chat_row = {prompt_column: prompt + answer, self.chat.images_column: images}
            samples = self.chat(chat_row)
            if len(samples) != 1:
                raise BadRow(column, f"the answer rendered as {len(samples)} samples, not one")
            (sample,) = samples
            if sample.get("videos"):
                raise BadRow(prompt_column, "videos in preference pairs are not read (SFT only)")
            item[f"{side}_tokens"], item[f"{side}_labels"] = sample["tokens"], sample["labels"]
            item["truncated"] = item["truncated"] or sample["truncated"]
            trained = any(label != IGNORE_INDEX for label in sample["labels"])
            item["completion"] = item["completion"] and trained
            if side == "chosen":
                item["images"], item["image_grids"] = sample["images"], sample["image_grids"]
            elif sample["images"] != item["images"]:
                # The same prompt with another answer: only a cut can drop an image.
                raise BadRow(column, "max_seq_len cuts the rejected side's images")
        return [item]


def image_preference_dataset(
    tokenizer: Tokenizer,
    *,
    source: str,
    data_files: Any = None,
    split: str = "train",
    column_map: dict[str, str] | None = None,
    images_column: str = "images",
    image_token: str = "<|image_pad|>",
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_pixels_per_sample: int | None = None,
    template_kwargs: dict[str, Any] | None = None,
    max_seq_len: int | None = None,
    skip_malformed: bool = False,
    num_proc: int | None = None,
    cache_dir: str | None = None,
) -> TokenizedDataset:
    """Preference pairs whose prompt holds images, as ``preference_dataset`` items plus images.

    Args:
        tokenizer: The tokenizer (passed by the recipe), with its chat template; its folder's
            ``preprocessor_config.json`` is the model's image preprocessing.
        source: As for ``preference_dataset`` (``json`` with ``data_files``, a file, ...).
        data_files: File path(s) for a loader ``source``; relative image paths are read from
            the folder of the file that names them.
        split: Split to read.
        column_map: Our column name to the file's; keys among ``prompt``, ``chosen``,
            ``rejected``.
        images_column: The column of image files for ``<image>`` placeholders in the prompt.
        image_token: The token the chat template writes once per image.
        max_image_pixels: Largest area an image file may declare (a decompression bomb).
        max_pixels_per_sample: Pixels of one row's images together, after resizing: a row
            over it has all its images downscaled by one factor (fewer image tokens), one that
            cannot fit even at the smallest size is malformed (``tunelab.data.image_budget``).
            None: no budget.
        template_kwargs: Extra variables for the chat template.
        max_seq_len: Cut each side to this many tokens (default: the tokenizer's); a cut inside
            an image is a malformed row.
        skip_malformed: Skip malformed rows (counted in ``num_skipped``) instead of raising.
        num_proc: Tokenizing processes (default: as ``chat_dataset``).
        cache_dir: Root of the tokenized cache.

    Returns:
        The dataset, items ``{"chosen_tokens", "chosen_labels", "rejected_tokens",
        "rejected_labels", "images", "image_grids"}``.

    Raises:
        ConfigError: No chat template, no ``max_seq_len``, or an unknown ``column_map`` key.
        DataError: A malformed row or image (file, line, 0-based row, column).
    """
    columns = resolve_columns(
        {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
        column_map,
        "image_preference_dataset",
    )
    chat_rows, settings, max_seq_len = image_rows_per_file(
        tokenizer,
        "image_preference_dataset",
        column=columns["prompt"],
        images_column=images_column,
        image_token=image_token,
        max_image_pixels=max_image_pixels,
        max_pixels_per_sample=max_pixels_per_sample,
        max_seq_len=max_seq_len,
        template_kwargs=template_kwargs,
    )

    def rows_for(name: str, present: list[str]) -> ImagePreferenceRows:
        return ImagePreferenceRows(chat_rows(name), columns)

    return build_tokenized(
        tokenizer,
        builder="image_preference_dataset",
        settings={**settings, "columns": columns},
        rows_for=rows_for,
        sources=resolve_sources(source, data_files, split),
        skip_malformed=skip_malformed,
        kind="preference_images",
        max_seq_len=max_seq_len,
        num_proc=num_proc,
        cache_dir=cache_dir,
    )


@dataclass(frozen=True)
class ImagePairCollate:
    """``padded_collate_dpo`` for pairs with images, picklable (for workers).

    Chosen rows then rejected rows, and every row's pixels in that order.
    """

    processing: Any
    """The model's image preprocessing (``image_processing_for``)."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __call__(self, batch: list[dict[str, Any]], pad_id: int, ignore_index: int = -100) -> Any:
        """Collate ``batch`` (``padded_collate_dpo``'s keys) and read its images."""
        rows = [
            {
                "tokens": item[f"{side}_tokens"],
                "labels": item[f"{side}_labels"],
                "images": item.get("images"),
                "image_grids": item.get("image_grids"),
            }
            for side in SIDES
            for item in batch
        ]
        out = padded_collate_images(
            rows, pad_id, self.processing, ignore_index, self.max_image_pixels
        )
        # pair_index and margin, as padded_collate_dpo gives them (its tokens are these).
        pairs = padded_collate_dpo(batch, pad_id, ignore_index)
        return {**pairs, **out}


def preference_collate(tokenizer: Tokenizer) -> Callable[..., Any]:
    """The preference collate for the tokenizer's model (``Datasets``' ``collate_fn``).

    ``padded_collate_dpo``, or for a vision-language model (its ``preprocessor_config.json``
    beside the tokenizer) an ``ImagePairCollate`` that also reads each batch's images.
    """
    processing = image_processing_for(tokenizer)
    return padded_collate_dpo if processing is None else ImagePairCollate(processing)
