r"""Images for Gemma 3: square resizing, pan-and-scan crops, and the text an image becomes.

The pixels equal transformers' ``Gemma3ImageProcessorPil`` value for value:

1. the image is read with pillow and made RGB, transparency composited onto white;
2. with pan-and-scan on, an image whose sides differ by at least
   ``pan_and_scan_min_ratio_to_activate`` is also cut along its long side into
   ``n = clamp(round(long / short), 2, pan_and_scan_max_num_crops)`` crops (fewer if a crop
   would be under ``pan_and_scan_min_crop_size`` pixels: then none), each ``ceil(side / n)``
   long, read from the original pixels;
3. the image and each crop are resized to ``image_size`` square (bilinear by default);
4. values become ``x * rescale_factor`` (float64, stored float32), then ``(x - mean) / std``.

Each piece is ``tokens_per_image`` soft tokens. The processor writes an image into the text as
``"\n\n" + boi + image_token * tokens_per_image + eoi + "\n\n"`` in place of the ``boi``
the chat template wrote, and an image with crops as ``"Here is the original image " + that +
" and here are some crops to help you see better " + " ".join(that, once per crop)``: the text
is replaced before it is tokenised, so the newlines merge with the text around them as the
processor's do.
"""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from tunelab.data.images import ImageError, to_rgb
from tunelab.errors import ConfigError

GEMMA3_PROCESSOR = "Gemma3Processor"


@dataclass(frozen=True)
class Gemma3ImageProcessing:
    """How Gemma 3 reads images (its ``preprocessor_config.json`` and processor settings)."""

    image_size: int = 896
    """Side every image and crop is resized to, in pixels (``size``)."""
    patch_size: int = 14
    """The vision tower's patch side (for the grid an image reports)."""
    tokens_per_image: int = 256
    """Soft tokens per image or crop (``image_seq_length``)."""
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Per-channel mean subtracted after rescaling."""
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Per-channel standard deviation divided by."""
    rescale_factor: float = 1 / 255
    """What each byte is multiplied by first."""
    resample: int = int(Image.Resampling.BILINEAR)
    """Pillow's resampling filter (``resample``; 2 is bilinear)."""
    do_pan_and_scan: bool = False
    """Add crops of images with a long side (``do_pan_and_scan``)."""
    pan_and_scan_min_crop_size: int = 256
    """Smallest crop side, in pixels."""
    pan_and_scan_max_num_crops: int = 4
    """Most crops per image."""
    pan_and_scan_min_ratio_to_activate: float = 1.2
    """Smallest long-over-short side ratio that gets crops."""
    boi_token: str = "<start_of_image>"
    """The token the chat template writes once per image, which the image's text replaces."""
    image_token: str = "<image_soft_token>"
    """The token each soft token stands in."""
    eoi_token: str = "<end_of_image>"
    """The token after an image's soft tokens."""

    @classmethod
    def from_preprocessor_config(
        cls, config: dict[str, Any], processor: dict[str, Any] | None = None
    ) -> "Gemma3ImageProcessing":
        """Read a ``preprocessor_config.json`` (and ``processor_config.json``) dict.

        ``null`` values take the processor's defaults, as transformers does.

        Raises:
            ConfigError: resizing, rescaling or normalising switched off, or a size that is
                not square.
        """
        defaults = cls()

        def value(key: str, default: Any) -> Any:
            found = config.get(key)
            if found is None:
                found = (processor or {}).get(key)
            return default if found is None else found

        for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(key) is False:
                raise ConfigError(f"Gemma 3 preprocessor_config.json {key}: false is not supported")
        size = config.get("size") or {}
        height, width = (
            size.get("height", defaults.image_size),
            size.get("width", defaults.image_size),
        )
        if height != width:
            raise ConfigError(f"Gemma 3 preprocessor_config.json size {size} is not square")
        return cls(
            image_size=int(height),
            patch_size=int(value("patch_size", defaults.patch_size)),
            tokens_per_image=int(value("image_seq_length", defaults.tokens_per_image)),
            image_mean=tuple(value("image_mean", defaults.image_mean)),
            image_std=tuple(value("image_std", defaults.image_std)),
            rescale_factor=float(value("rescale_factor", defaults.rescale_factor)),
            resample=int(value("resample", defaults.resample)),
            do_pan_and_scan=bool(value("do_pan_and_scan", defaults.do_pan_and_scan)),
            pan_and_scan_min_crop_size=int(
                value("pan_and_scan_min_crop_size", defaults.pan_and_scan_min_crop_size)
            ),
            pan_and_scan_max_num_crops=int(
                value("pan_and_scan_max_num_crops", defaults.pan_and_scan_max_num_crops)
            ),
            pan_and_scan_min_ratio_to_activate=float(
                value(
                    "pan_and_scan_min_ratio_to_activate",
                    defaults.pan_and_scan_min_ratio_to_activate,
                )
            ),
        )

    @property
    def placeholder(self) -> str:
        """The token the chat template writes once per image (``boi_token``)."""
        return self.boi_token

    def crops(self, height: int, width: int) -> list[tuple[int, int, int, int]]:
        """The pan-and-scan crops of an image, as ``(left, top, right, bottom)`` boxes.

        Empty when pan-and-scan is off or the image does not get crops (see the module
        docstring).
        """
        if not self.do_pan_and_scan:
            return []
        if min(height, width) <= 0:
            raise ImageError(f"an image of {width}x{height} pixels is empty")
        long_side, short_side = max(height, width), min(height, width)
        if long_side / short_side < self.pan_and_scan_min_ratio_to_activate:
            return []
        count = int(math.floor(long_side / short_side + 0.5))
        count = min(int(math.floor(long_side / self.pan_and_scan_min_crop_size)), count)
        count = min(self.pan_and_scan_max_num_crops, max(2, count))
        across = count if width >= height else 1
        down = 1 if width >= height else count
        crop_width, crop_height = math.ceil(width / across), math.ceil(height / down)
        if min(crop_width, crop_height) < self.pan_and_scan_min_crop_size:
            return []
        return [
            (left, top, min(left + crop_width, width), min(top + crop_height, height))
            for top in range(0, crop_height * down, crop_height)
            for left in range(0, crop_width * across, crop_width)
        ]

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """``(pieces, patch rows, patch columns)``: the image and its crops, each a square grid."""
        side = self.image_size // self.patch_size
        return 1 + len(self.crops(height, width)), side, side

    def num_tokens(self, height: int, width: int) -> int:
        """Soft tokens of an image of ``height x width`` pixels (its crops' included)."""
        return self.grid(height, width)[0] * self.tokens_per_image

    def image_text(self, num_crops: int) -> str:
        """The text the processor writes for an image with ``num_crops`` crops."""
        one = f"\n\n{self.boi_token}{self.image_token * self.tokens_per_image}{self.eoi_token}\n\n"
        if not num_crops:
            return one
        return (
            f"Here is the original image {one} and here are some crops to help you see better "
            + " ".join([one] * num_crops)
        )

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Pixel values of one image and its crops.

        Args:
            image: a pillow image (any mode).

        Returns:
            ``(pixel_values, grid)``: float32 ``[pieces, 3, image_size, image_size]`` and
            ``grid(height, width)``.
        """
        rgb = to_rgb(image)
        pieces = [rgb] + [rgb.crop(box) for box in self.crops(rgb.height, rgb.width)]
        table = self._value_table()
        side = (self.image_size, self.image_size)
        # Each channel's bytes are looked up straight into the output's plane (no stacking).
        values = np.empty((len(pieces), 3, self.image_size, self.image_size), dtype=np.float32)
        for index, piece in enumerate(pieces):
            if piece.size != side:
                piece = piece.resize(side, Image.Resampling(self.resample))
            data = np.asarray(piece)  # [H, W, 3] uint8
            for channel in range(3):
                np.take(table[channel], data[..., channel], out=values[index, channel], mode="clip")
        return torch.from_numpy(values), self.grid(rgb.height, rgb.width)

    def _value_table(self) -> np.ndarray:
        """``[3, 256]`` float32: byte ``v`` of channel ``c`` rescaled and normalised."""
        scaled = (np.arange(256, dtype=np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(self.image_std, dtype=np.float32)[:, None]
        return (scaled[None] - mean) / std
