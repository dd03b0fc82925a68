"""Images for Qwen2.5-VL: reading them safely and turning them into patches.

The result equals transformers' ``Qwen2VLImageProcessor`` (its PIL backend) value for value:

1. the image is read with pillow and made RGB, transparency composited onto white;
2. it is resized with bicubic resampling to the size ``smart_resize`` picks: each side a
   multiple of ``patch_size * merge_size``, the area within ``[min_pixels, max_pixels]``,
   the aspect ratio kept as closely as those allow;
3. values become ``x / 255`` (computed in float64, stored in float32), then
   ``(x - mean) / std`` per channel;
4. the ``C x H x W`` image is cut into patches ordered block-major (the patches of each
   ``merge_size`` square adjacent, squares row by row), each patch flattened as channel,
   frame, row, column with the image repeated over the ``temporal_patch_size`` frames.

An image of ``h x w`` patches becomes ``h * w / merge_size**2`` language tokens.

``open_image`` refuses what should not reach a worker: a missing or unreadable file, a
truncated one, an empty image, and one whose pixel count exceeds a limit (a decompression
bomb), each with one line naming the file.
"""

import math
import os
from dataclasses import dataclass
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
        # Scale and normalise through a 256-entry table per channel: the same float32 operations
        # on each byte as on the image, done once per value instead of once per pixel.
        table = self._value_table().numpy()
        data = np.asarray(rgb)  # [H, W, 3] uint8
        pixels = np.stack([table[channel][data[..., channel]] for channel in range(3)])
        return patchify(
            torch.from_numpy(pixels), self.patch_size, self.merge_size, self.temporal_patch_size
        )

    def _value_table(self) -> torch.Tensor:
        """``[3, 256]`` float32: byte ``v`` of channel ``c`` scaled and normalised."""
        scaled = (torch.arange(256, dtype=torch.float64) * (1 / 255)).float()
        mean = torch.tensor(self.image_mean, dtype=torch.float32)[:, None]
        std = torch.tensor(self.image_std, dtype=torch.float32)[:, None]
        return (scaled[None] - mean) / std


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


def patchify(
    pixels: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Cut a normalised ``[C, H, W]`` image into flattened, block-major patches.

    Args:
        pixels: ``[channels, height, width]`` (any dtype), sides multiples of
            ``patch_size * merge_size``.
        patch_size: side of a patch.
        merge_size: side of a merge square, in patches.
        temporal_patch_size: frames per patch (the image is repeated).

    Returns:
        ``(patches, (1, rows, columns))`` with ``patches`` ``[rows * columns, C * T * P * P]``.
    """
    channels, height, width = pixels.shape
    rows, columns = height // patch_size, width // patch_size
    blocks = pixels.view(
        channels,
        rows // merge_size,
        merge_size,
        patch_size,
        columns // merge_size,
        merge_size,
        patch_size,
    )
    # -> block row, block column, row in block, column in block, channel, pixel row, column
    blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6)
    frames = blocks[:, :, :, :, :, None].expand(
        *blocks.shape[:5], temporal_patch_size, *blocks.shape[5:]
    )
    patches = frames.reshape(rows * columns, channels * temporal_patch_size * patch_size**2)
    return patches, (1, rows, columns)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (transformers' rule)."""
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
