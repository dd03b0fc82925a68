"""A pixel budget per sample: the images of one row downscaled together to fit it.

``max_pixels_per_sample`` bounds the pixels the model sees for one row's images, summed
after resizing (the preprocessing's own ``min_pixels``/``max_pixels`` bound each image; this
bounds them together, so a row with many images cannot flood the sequence with image tokens).

- Qwen2.5-VL / Qwen3-VL (``ImageProcessing``): a row over the budget has every image scaled
  by the same factor ``s``: image ``i``, ``A_i`` pixels after the usual resize, is resized as
  the processor would with ``max_pixels = floor(A_i * s)`` (``smart_resize``, sides multiples
  of ``patch_size * merge_size``), ``s`` the largest that keeps the sum within the budget
  (``budget_scale``), so relative sizes are kept and the image tokens shrink with the pixels.
  A row under the budget is unchanged. A row whose images cannot fit even at the smallest
  size (one ``factor x factor`` square each) is refused.
- Gemma 3 (``Gemma3ImageProcessing``): every image and crop is ``image_size`` square and
  ``mm_tokens_per_image`` tokens whatever its size, so nothing can be downscaled: a row over
  the budget is refused.

The samples keep each image's patch grid; the collate resizes an image to the grid recorded
for it (``patches_for_grid``), so the pixels equal the processor's with that image's share
as ``max_pixels``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from PIL import Image

from tunelab.data.images import ImageError, ImageProcessing, to_rgb
from tunelab.data.images_gemma3 import Gemma3ImageProcessing

__all__ = ["budget_processings", "budget_scale", "patches_for_grid"]

_BISECTIONS = 32
"""Halvings of the interval the budget's factor is searched in (to 2**-32)."""


def _area(processing: ImageProcessing, size: tuple[int, int]) -> int:
    height, width = processing.resized_size(*size)
    return height * width


def budget_processings(
    processing: ImageProcessing | Gemma3ImageProcessing,
    sizes: list[tuple[int, int]],
    max_pixels_per_sample: int | None,
) -> list[Any]:
    """The preprocessing of each image of one row, its share of the budget applied.

    Args:
        processing: The model's image preprocessing.
        sizes: Each image's ``(height, width)`` as read (upright).
        max_pixels_per_sample: The budget: pixels of all the row's images after resizing
            (None: no budget).

    Returns:
        One preprocessing per image: ``processing`` itself when the row fits, else (Qwen) a
        copy whose ``max_pixels`` (and ``min_pixels``, when larger) is the image's share.

    Raises:
        ImageError: The row cannot fit the budget (one line with the numbers).
    """
    if max_pixels_per_sample is None or not sizes:
        return [processing] * len(sizes)
    budget = max_pixels_per_sample
    if isinstance(processing, Gemma3ImageProcessing):
        pieces = [processing.grid(height, width)[0] for height, width in sizes]
        total = sum(pieces) * processing.image_size**2
        if total > budget:
            raise ImageError(
                f"the row's {len(sizes)} images are {sum(pieces)} pieces of "
                f"{processing.image_size}x{processing.image_size} = {total} pixels, over "
                f"max_pixels_per_sample {budget} (Gemma 3's images have a fixed size and "
                "cannot be downscaled)"
            )
        return [processing] * len(sizes)
    areas = [_area(processing, size) for size in sizes]
    total = sum(areas)
    if total <= budget:
        return [processing] * len(sizes)
    smallest = len(sizes) * processing.factor**2
    if smallest > budget:
        raise ImageError(
            f"the row's {len(sizes)} images are {total} pixels after resizing and at least "
            f"{smallest} at the smallest size ({len(sizes)} x {processing.factor}x"
            f"{processing.factor}), over max_pixels_per_sample {budget}"
        )
    scale = budget_scale(processing, sizes, budget)
    return [_shared(processing, area, scale) for area in areas]


def _shared(processing: ImageProcessing, area: int, scale: float) -> ImageProcessing:
    """``processing`` with ``max_pixels`` the share ``floor(area * scale)`` (at least 1)."""
    share = max(1, math.floor(area * scale))
    return replace(processing, max_pixels=share, min_pixels=min(processing.min_pixels, share))


def budget_scale(processing: ImageProcessing, sizes: list[tuple[int, int]], budget: int) -> float:
    """The largest factor ``s`` whose shares ``floor(A_i * s)`` fit the budget once resized.

    ``A_i`` is image ``i``'s area after the processor's own resize; each image is resized as
    the processor would with ``max_pixels`` its share. The sides round down to multiples of
    ``patch_size * merge_size``, so the sum often falls well short of ``s * sum(A)``: ``s`` is
    searched (bisection) for the most pixels within the budget.

    Args:
        processing: The model's Qwen preprocessing.
        sizes: Each image's ``(height, width)``.
        budget: ``max_pixels_per_sample``; at least one ``factor`` square per image.

    Returns:
        The factor, in ``(0, 1)``.
    """
    areas = [_area(processing, size) for size in sizes]

    def used(scale: float) -> int:
        return sum(
            _area(_shared(processing, area, scale), size)
            for area, size in zip(areas, sizes, strict=True)
        )

    low, high = 0.0, 1.0  # used(0) fits (a factor square each), used(1) = sum(areas) does not
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        if used(middle) <= budget:
            low = middle
        else:
            high = middle
    return low


def patches_for_grid(
    processing: ImageProcessing | Gemma3ImageProcessing,
    image: Image.Image,
    grid: Any,
    path: str,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An image's patches for the grid its tokens were counted with.

    The grid is the image's own (``processing``'s), or for Qwen a smaller one the row's pixel
    budget gave it: the image is then resized to that grid (bicubic, as the processor resizes)
    and cut as the processor cuts it.

    Args:
        processing: The model's image preprocessing (the rows were tokenised with it).
        image: The image, read now.
        grid: ``(frames, patch rows, patch columns)`` recorded for it.
        path: Its file or URL, for errors.

    Returns:
        ``(pixel_values, grid)`` as ``processing`` returns them.

    Raises:
        ImageError: The image's grid is neither its own nor a downscale of it (the file
            changed after tokenising).
    """
    expected = tuple(grid)
    own = tuple(processing.grid(image.height, image.width))
    if own == expected:
        return processing(image)
    downscaled = (
        isinstance(processing, ImageProcessing)
        and expected[0] == own[0]
        and expected[1] <= own[1]
        and expected[2] <= own[2]
    )
    if not downscaled:
        raise ImageError(
            f"{path}: the image is now {list(own)} patches, not the {list(expected)} its "
            "tokens were counted for (the file changed after tokenising)"
        )
    height, width = expected[1] * processing.patch_size, expected[2] * processing.patch_size
    resized = to_rgb(image).resize((width, height), Image.Resampling.BICUBIC)
    exact = replace(processing, min_pixels=height * width, max_pixels=height * width)
    return exact(resized)
