"""Images for Qwen2.5-VL: reading them safely and turning them into patches.

The result equals transformers' ``Qwen2VLImageProcessor`` (its PIL backend) value for value:

1. the image is read with pillow and made RGB, transparency composited onto white;
2. it is resized with bicubic resampling to the size ``smart_resize`` picks: each side a
   multiple of ``patch_size * merge_size``, the area within ``[min_pixels, max_pixels]``,
   the aspect ratio kept as closely as those allow;
3. values become ``x / 255`` (transformers computes it in float64 and stores float32; float32
   division gives the same float32 for every byte), then ``(x - mean) / std`` per channel in
   float32;
4. the ``C x H x W`` image is cut into patches ordered block-major (the patches of each
   ``merge_size`` square adjacent, squares row by row), each patch flattened as channel,
   frame, row, column with the image repeated over the ``temporal_patch_size`` frames.

Done for speed (``ImageProcessing.patches``): the bytes are cut into patches first (one byte
a value), made float32 and normalised in place there (the same float32 operations, in the same
order, on each value as transformers'), and repeated over the frames in one copy into an
output numpy allocates (numpy asks the kernel for huge pages on large arrays, which makes a
fresh 50 MB output several times cheaper to fault in than torch's own allocation).

An image of ``h x w`` patches becomes ``h * w / merge_size**2`` language tokens.

``open_image`` refuses what should not reach a worker: a missing or unreadable file, a
truncated one, an empty image, and one whose pixel count exceeds a limit (a decompression
bomb), each with one line naming the file.
"""

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from tunelab.errors import DataError

# OpenAI CLIP's normalisation, which the Qwen2-VL processors default to.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
"""The longest side over the shortest that ``smart_resize`` accepts (transformers' limit)."""


class ImageError(DataError):
    """An image that cannot be used; the message is one line naming the file."""


@dataclass(frozen=True)
class ImageProcessing:
    """How images become patches (the fields of a Qwen2-VL ``preprocessor_config.json``)."""

    min_pixels: int = 56 * 56
    """Smallest area after resizing, in pixels."""
    max_pixels: int = 28 * 28 * 1280
    """Largest area after resizing, in pixels (bounds the tokens per image)."""
    patch_size: int = 14
    """Side of a patch, in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch; a still image is repeated to fill them."""
    merge_size: int = 2
    """Side of the square of patches that becomes one language token."""
    image_mean: tuple[float, float, float] = CLIP_MEAN
    """Per-channel mean subtracted after scaling to [0, 1]."""
    image_std: tuple[float, float, float] = CLIP_STD
    """Per-channel standard deviation divided by."""

    @classmethod
    def from_preprocessor_config(cls, config: dict[str, Any]) -> "ImageProcessing":
        """Read a ``preprocessor_config.json`` dict (``size`` or ``min_pixels``/``max_pixels``)."""
        size = config.get("size") or {}
        defaults = cls()
        return cls(
            min_pixels=int(
                config.get("min_pixels") or size.get("shortest_edge") or defaults.min_pixels
            ),
            max_pixels=int(
                config.get("max_pixels") or size.get("longest_edge") or defaults.max_pixels
            ),
            patch_size=int(config.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(
                config.get("temporal_patch_size", defaults.temporal_patch_size)
            ),
            merge_size=int(config.get("merge_size", defaults.merge_size)),
            image_mean=tuple(config.get("image_mean", defaults.image_mean)),
            image_std=tuple(config.get("image_std", defaults.image_std)),
        )

    @property
    def factor(self) -> int:
        """What each resized side is a multiple of: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """``smart_resize`` with these settings."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """``(frames, patch rows, patch columns)`` of an image of ``height x width`` pixels."""
        resized_height, resized_width = self.resized_size(height, width)
        return 1, resized_height // self.patch_size, resized_width // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        """Language tokens of an image of ``height x width`` pixels (before resizing)."""
        resized_height, resized_width = self.resized_size(height, width)
        return resized_height * resized_width // (self.factor**2)

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Patches of one image.

        Args:
            image: a pillow image (any mode).

        Returns:
            ``(pixel_values, grid)``: float32 ``[patches, channels * temporal_patch_size *
            patch_size**2]`` and ``(1, patch rows, patch columns)``.
        """
        rgb = to_rgb(image)
        height, width = self.resized_size(rgb.height, rgb.width)
        if (height, width) != (rgb.height, rgb.width):
            rgb = rgb.resize((width, height), Image.Resampling.BICUBIC)
        return self.patches(np.asarray(rgb))

    def patches(self, data: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Normalised, block-major patches of a resized image's bytes.

        Args:
            data: ``uint8 [height, width, 3]`` (pillow's layout), sides multiples of
                ``patch_size * merge_size``.

        Returns:
            ``(pixel_values, grid)`` as ``__call__`` returns them.
        """
        height, width, channels = data.shape
        side, merge, frames = self.patch_size, self.merge_size, self.temporal_patch_size
        rows, columns = height // side, width // side
        count = rows * columns
        # -> block row, block column, row in block, column in block, channel, pixel row, column
        blocks = data.reshape(rows // merge, merge, side, columns // merge, merge, side, channels)
        blocks = np.ascontiguousarray(blocks.transpose(0, 3, 1, 4, 6, 2, 5))
        values = _empty((count, channels, 1, side * side))
        values.copy_(torch.from_numpy(blocks).view(values.shape))
        mean, std = _normalisation(tuple(self.image_mean), tuple(self.image_std))
        values.div_(255.0).sub_(mean).div_(std)
        if frames > 1:
            repeated = _empty((count, channels, frames, side * side))
            repeated.copy_(values.expand(repeated.shape))
            values = repeated
        return values.view(count, channels * frames * side * side), (1, rows, columns)


def _empty(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised float32 tensor in memory numpy allocates (huge pages when large)."""
    return torch.from_numpy(np.empty(shape, dtype=np.float32))


@lru_cache(maxsize=16)
def _normalisation(
    mean: tuple[float, ...], std: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel float32 mean and std shaped ``[C, 1, 1]`` (against ``[N, C, 1, P*P]``)."""
    as_column = (len(mean), 1, 1)
    return (
        torch.tensor(mean, dtype=torch.float32).view(as_column),
        torch.tensor(std, dtype=torch.float32).view(as_column),
    )


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The size an image is resized to: sides multiples of ``factor``, area bounded.

    Each side is first rounded to the nearest multiple of ``factor``. If that area exceeds
    ``max_pixels``, both sides shrink by ``b = sqrt(height * width / max_pixels)`` and round
    down (at least ``factor``); if it is under ``min_pixels``, both grow by
    ``sqrt(min_pixels / (height * width))`` and round up.

    Args:
        height: the image's height in pixels.
        width: its width.
        factor: ``patch_size * merge_size``.
        min_pixels: smallest area.
        max_pixels: largest area.

    Returns:
        ``(height, width)`` after resizing.

    Raises:
        ImageError: an empty image, or sides more than ``MAX_ASPECT_RATIO`` apart.
    """
    if min(height, width) <= 0:
        raise ImageError(f"an image of {width}x{height} pixels is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            f"an image of {width}x{height} pixels has an aspect ratio over {MAX_ASPECT_RATIO}"
        )
    rounded_height = round(height / factor) * factor
    rounded_width = round(width / factor) * factor
    if rounded_height * rounded_width > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        rounded_height = max(factor, math.floor(height / shrink / factor) * factor)
        rounded_width = max(factor, math.floor(width / shrink / factor) * factor)
    elif rounded_height * rounded_width < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        rounded_height = math.ceil(height * grow / factor) * factor
        rounded_width = math.ceil(width * grow / factor) * factor
    return rounded_height, rounded_width


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (transformers' rule).

    An RGB image without a transparent colour is returned as it is (not copied).
    """
    if image.mode == "RGB" and image.info.get("transparency") is None:
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def open_image(path: str | os.PathLike, max_image_pixels: int) -> Image.Image:
    """Read an image whole, upright, refusing what cannot or should not be decoded.

    The pixel count is checked from the header, before any pixel is decoded, so a small file
    that would decode to gigabytes (a decompression bomb) is refused cheaply. A photo whose
    EXIF orientation says it was taken turned is turned upright, as transformers'
    ``load_image`` does before its processor sees it (a portrait phone photo is stored
    landscape): its size, grid and image tokens are the upright image's.

    Args:
        path: the image file.
        max_image_pixels: the largest ``width * height`` accepted.

    Returns:
        The decoded image.

    Raises:
        ImageError: a missing, unreadable, truncated, empty or too large image.
    """
    try:
        if os.path.getsize(path) == 0:
            raise ImageError(f"{path}: the image file is empty (0 bytes)")
        with Image.open(path) as image:
            width, height = image.size
            if width * height == 0:
                raise ImageError(f"{path}: the image is empty ({width}x{height} pixels)")
            if width * height > max_image_pixels:
                raise ImageError(
                    f"{path}: {width}x{height} = {width * height} pixels is over the limit of "
                    f"{max_image_pixels} (data.max_image_pixels): a decompression bomb, or "
                    "raise the limit"
                )
            image.load()
            return ImageOps.exif_transpose(image)  # a copy, upright: the file is closed after
    except FileNotFoundError:
        raise ImageError(f"{path}: image file not found") from None
    except UnidentifiedImageError:
        raise ImageError(f"{path}: not an image pillow can read") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        if isinstance(error, ImageError):
            raise
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ImageError(f"{path}: unreadable or truncated image ({reason})") from None
