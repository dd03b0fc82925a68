"""``image_chat_dataset``: chat rows with images as SFT samples, tokenised and cached.

The rows are read as ``tunelab.data.image_rows`` describes (content parts or an ``images``
column with ``<image>`` placeholders); every image is opened and decoded when the dataset is
built, once per machine, so a bad image stops the build with its file and line before any
worker starts (or, with ``skip_malformed``, the row is skipped); an image named by URL is
fetched then, once per machine, into the image cache (``tunelab.data.image_sources``). The
cached samples hold each image's file (or URL) and patch grid; the pixels are read by the
collate (``tunelab.data.image_rows.padded_collate_images``), in the loader: in its worker
processes with ``schedule.dataloader_workers``. With ``packed`` a pack holds whole samples, each with its images (``tunelab.data.packing``).
"""

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tunelab.data.chat import chat_template_of
from tunelab.data.collate import padded_collate_sft
from tunelab.data.image_rows import DEFAULT_MAX_IMAGE_PIXELS, ImageChatRows, padded_collate_images
from tunelab.data.image_sources import DEFAULT_FETCH_TIMEOUT, DEFAULT_MAX_IMAGE_BYTES, ImageFetch
from tunelab.data.images import ImageProcessing
from tunelab.data.images_gemma3 import GEMMA3_PROCESSOR, Gemma3ImageProcessing
from tunelab.data.sources import resolve_sources
from tunelab.data.tokenized import TokenizedDataset, build_tokenized
from tunelab.data.tokenizer import Tokenizer
from tunelab.data.video_rows import VIDEO_COLUMNS, collate_videos, video_processing_for
from tunelab.data.videos import VideoProcessing
from tunelab.errors import ConfigError

PREPROCESSOR_CONFIG = "preprocessor_config.json"


def image_processing_for(tokenizer: Tokenizer) -> ImageProcessing | Gemma3ImageProcessing | None:
    """The image preprocessing of the model the tokenizer belongs to, or None (text-only).

    Read from ``preprocessor_config.json`` beside the tokenizer's files, which a
    vision-language checkpoint carries and a text-only one does not: Gemma 3's (its
    ``processor_class`` or ``image_processor_type``, with ``processor_config.json``'s
    ``image_seq_length``), else Qwen2-VL's.
    """
    folder = Path(tokenizer.source).parent
    path = folder / PREPROCESSOR_CONFIG
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    processor_path = folder / "processor_config.json"
    processor = json.loads(processor_path.read_text()) if processor_path.is_file() else {}
    kind = str(config.get("image_processor_type") or "")
    if GEMMA3_PROCESSOR in (config.get("processor_class"), processor.get("processor_class")) or (
        kind.startswith("Gemma3")
    ):
        return Gemma3ImageProcessing.from_preprocessor_config(config, processor)
    return ImageProcessing.from_preprocessor_config(config)


@dataclass(frozen=True)
class ImageCollate:
    """``padded_collate_images`` with its preprocessing bound (picklable, for workers)."""

    processing: ImageProcessing | Gemma3ImageProcessing
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    videos: VideoProcessing | None = None
    """How the samples' videos become patches (``tunelab.data.video_rows.collate_videos``)."""

    def __call__(self, batch: list[dict[str, Any]], pad_id: int, ignore_index: int = -100) -> Any:
        """Collate ``batch`` and read its images and videos (see ``padded_collate_images``)."""
        plain = [{k: v for k, v in item.items() if k not in VIDEO_COLUMNS} for item in batch]
        out = padded_collate_images(
            plain, pad_id, self.processing, ignore_index, self.max_image_pixels
        )
        if self.videos is not None:
            out.update(collate_videos(batch, self.videos, self.max_image_pixels))
        return out


def sft_collate(tokenizer: Tokenizer) -> Callable[..., Any]:
    """The SFT collate for the tokenizer's model (``Datasets``' ``collate_fn``).

    ``padded_collate_sft``, or for a vision-language model (its ``preprocessor_config.json``
    beside the tokenizer) an ``ImageCollate`` that also reads each batch's images.
    """
    processing = image_processing_for(tokenizer)
    if processing is None:
        return padded_collate_sft
    return ImageCollate(processing, videos=video_processing_for(tokenizer))


def image_rows_per_file(
    tokenizer: Tokenizer,
    builder: str,
    *,
    column: str,
    images_column: str,
    image_token: str,
    max_image_pixels: int,
    max_seq_len: int | None,
    template_kwargs: dict[str, Any] | None,
    fetch: ImageFetch | None = None,
    max_pixels_per_sample: int | None = None,
) -> tuple[Callable[[str], ImageChatRows], dict[str, Any], int]:
    """How a dataset builder with images renders rows: ``ImageChatRows`` per source file.

    Args:
        tokenizer: The tokenizer; its folder's ``preprocessor_config.json`` is the model's image
            preprocessing (which the collate uses too), its chat template renders the rows.
        builder: The builder's name, for errors.
        column: The column of messages.
        images_column: The column of image files for ``<image>`` placeholders.
        image_token: The token the chat template writes once per image.
        max_image_pixels: Largest area an image file may declare.
        max_seq_len: Cut samples to this many tokens; None: the tokenizer's.
        template_kwargs: Extra variables for the chat template.
        fetch: How images named by URL are fetched (None: the defaults).
        max_pixels_per_sample: Pixels of a row's images together after resizing; a row over
            it is downscaled (``tunelab.data.image_budget``). None: no budget.

    Returns:
        ``(rows_for, settings, max_seq_len)``: the row function of a source file (relative
        image paths read from its folder), the settings that key the cache, the length used.

    Raises:
        ConfigError: No chat template, or no ``max_seq_len`` here or in the tokenizer.
    """
    processing = image_processing_for(tokenizer)
    max_seq_len = max_seq_len or tokenizer.max_seq_len
    if max_seq_len is None:
        raise ConfigError(f"{builder} needs max_seq_len (or the tokenizer's)")
    template = chat_template_of(tokenizer)
    videos = video_processing_for(tokenizer)
    fetch = fetch or ImageFetch()

    def rows_for(name: str) -> ImageChatRows:
        folder = Path(name).parent if Path(name).is_file() else None
        return ImageChatRows(
            tokenizer=tokenizer,
            template=template,
            column=column,
            processing=processing,
            image_token=image_token,
            image_dir=None if folder is None else str(folder),
            images_column=images_column,
            max_image_pixels=max_image_pixels,
            max_seq_len=max_seq_len,
            template_kwargs=template_kwargs,
            videos=videos,
            fetch=fetch,
            max_pixels_per_sample=max_pixels_per_sample,
        )

    settings = dict(
        conversation_column=column,
        images_column=images_column,
        image_token=image_token,
        processing=None if processing is None else asdict(processing),
        videos=None if videos is None else asdict(videos),
        max_image_pixels=max_image_pixels,
        max_image_bytes=fetch.max_bytes,
        template_kwargs=template_kwargs,
        max_seq_len=max_seq_len,
    )
    if max_pixels_per_sample is not None:  # absent when unset: earlier caches stay valid
        settings["max_pixels_per_sample"] = max_pixels_per_sample
    return rows_for, settings, max_seq_len


def image_chat_dataset(
    tokenizer: Tokenizer,
    *,
    source: str,
    data_files: Any = None,
    split: str = "train",
    conversation_column: str = "messages",
    images_column: str = "images",
    image_token: str = "<|image_pad|>",
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    image_fetch_timeout: float = DEFAULT_FETCH_TIMEOUT,
    max_pixels_per_sample: int | None = None,
    template_kwargs: dict[str, Any] | None = None,
    max_seq_len: int | None = None,
    packed: bool = False,
    skip_malformed: bool = False,
    num_proc: int | None = None,
    cache_dir: str | None = None,
) -> TokenizedDataset:
    """Conversations with images as SFT samples; only the assistant's text is trained.

    Args:
        tokenizer: The tokenizer (passed by the recipe), with its chat template.
        source: As for ``chat_dataset`` (``json`` with ``data_files``, a file, a hub id).
        data_files: File path(s) for a loader ``source``; relative image paths are read from
            the folder of the file that names them. An image may also be an http(s) URL or a
            ``data:`` URI.
        split: Split to read.
        conversation_column: The column of OpenAI-style messages.
        images_column: The column of image files for ``<image>`` placeholders.
        image_token: The token the chat template writes once per image (Qwen's; Gemma 3's
            processor names its own: ``<start_of_image>``, replaced by the image's text).
        max_image_pixels: Largest area an image file may declare (a decompression bomb).
        max_image_bytes: Largest image a URL or ``data:`` URI may hold, in bytes.
        image_fetch_timeout: Seconds a URL may take to answer and to send its image.
        max_pixels_per_sample: Pixels of one row's images together, after resizing: a row
            over it has all its images downscaled by one factor (fewer image tokens), one that
            cannot fit even at the smallest size is malformed (``tunelab.data.image_budget``).
            None: no budget.
        template_kwargs: Extra variables for the chat template.
        max_seq_len: Cut samples to this many tokens (default: the tokenizer's); a cut inside
            an image is a malformed row. With ``packed``, the length of a pack.
        packed: Pack samples into sequences of ``max_seq_len`` tokens, each with its images
            (``tunelab.data.packing``).
        skip_malformed: Skip malformed rows (counted in ``num_skipped``) instead of raising.
        num_proc: Tokenizing processes (default: as ``chat_dataset``).
        cache_dir: Root of the tokenized cache.

    Returns:
        The dataset, items ``{"tokens", "labels", "images", "image_grids"}`` (packs add
        ``input_pos`` and ``document_ids``).

    Raises:
        ConfigError: No chat template.
        DataError: A malformed row or image (file, line, 0-based row, column).
    """
    chat_rows, settings, max_seq_len = image_rows_per_file(
        tokenizer,
        "image_chat_dataset",
        column=conversation_column,
        images_column=images_column,
        image_token=image_token,
        max_image_pixels=max_image_pixels,
        max_seq_len=max_seq_len,
        template_kwargs=template_kwargs,
        fetch=ImageFetch(timeout=image_fetch_timeout, max_bytes=max_image_bytes),
        max_pixels_per_sample=max_pixels_per_sample,
    )
    sources = resolve_sources(source, data_files, split)

    def rows_for(name: str, present: list[str]) -> ImageChatRows:
        return chat_rows(name)

    return build_tokenized(
        tokenizer,
        builder="image_chat_dataset",
        settings=settings,
        rows_for=rows_for,
        sources=sources,
        skip_malformed=skip_malformed,
        kind="sft_images",
        packed=packed,
        max_seq_len=max_seq_len,
        num_proc=num_proc,
        cache_dir=cache_dir,
    )
