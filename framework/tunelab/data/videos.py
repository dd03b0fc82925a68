"""Videos for Qwen2.5-VL and Qwen3-VL: frames read safely and turned into patches.

A video is a list of frame images (or a folder of them, read in name order); video files are
not decoded (no decoder is a dependency): ``VIDEO_FILE_SUFFIXES`` are refused with one line
that says to give frames. The result equals transformers' video processors
(``Qwen2VLVideoProcessor``, which Qwen2.5-VL uses, and ``Qwen3VLVideoProcessor``) value for
value:

1. each frame is read with pillow, turned by its EXIF orientation and made RGB (transformers'
   ``load_image``); all frames of a video have one size;
2. optionally frames are sampled (``VideoProcessing.sample``: a number of frames or a rate,
   by the family's own rule), otherwise every frame is kept, as transformers does for a list
   of frames;
3. the frames are resized with antialiased bicubic interpolation on their bytes (torch's
   ``interpolate``, which is what torchvision's ``resize`` runs on CPU for ``uint8``) to the
   size the family's ``smart_resize`` picks (Qwen3-VL's counts the frames in the pixel budget);
4. values become ``(x - 255 * mean) / (255 * std)`` in float32 (transformers' fused rescale
   and normalise);
5. the frame count is padded to a multiple of ``temporal_patch_size`` by repeating the last
   frame, and the frames are cut into block-major patches of ``temporal_patch_size`` frames.

A video of ``t`` frame pairs of ``h x w`` patches becomes ``t * h * w / merge_size**2``
language tokens. Qwen2.5-VL places them after one ``<|vision_start|>`` and spaces their
temporal positions by ``second_per_grid_ts`` (``temporal_patch_size / fps``); Qwen3-VL writes
each pair after its timestamp (``<1.0 seconds>``, the mean time of its two frames), in a
``<|vision_start|> ... <|vision_end|>`` pair of its own (``VideoProcessing.text``).

``fps`` is the rate of the frames as given (a row's video part may say it): transformers
takes 24 when a list of frames comes without metadata, and so does tunelab.
"""

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from tunelab.data.images import (
    CLIP_MEAN,
    CLIP_STD,
    MAX_ASPECT_RATIO,
    ImageError,
    open_image,
    smart_resize,
)

VIDEO_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
"""The families whose videos tunelab reads (Gemma 3 has no video input)."""
VIDEO_FILE_SUFFIXES = (".mp4", ".mov", ".mkv", ".avi", ".webm", ".m4v", ".mpeg", ".mpg")
"""Video files, which are not decoded: their frames are given instead."""
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
"""The frame files a folder video holds (others in the folder are ignored)."""
DEFAULT_FPS = 24.0
"""The rate of frames given without one (transformers' default for a list of frames)."""
VIDEO_START, VIDEO_PAD, VIDEO_END = "<|vision_start|>", "<|video_pad|>", "<|vision_end|>"
"""What the Qwen chat templates write for a video: start, one pad token, end."""
# The family's video processor class defaults (transformers 5): min and max pixels, patch
# side, mean and std, and cap_pixels_per_frame's token budget.
_DEFAULTS = {
    "qwen2_5_vl": (128 * 28 * 28, 28 * 28 * 768, 14, CLIP_MEAN, CLIP_STD, 128000),
    "qwen3_vl": (128 * 32 * 32, 32 * 32 * 768, 16, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), 768),
}


class VideoError(ImageError):
    """A video that cannot be used; the message is one line naming the video or frame."""


@dataclass(frozen=True)
class VideoProcessing:
    """How a family's videos become patches (a ``video_preprocessor_config.json``'s fields)."""

    family: str
    """``qwen2_5_vl`` or ``qwen3_vl``: whose resizing, sampling and timestamp rules."""
    min_pixels: int
    """Smallest frame area after resizing (``size.shortest_edge``); Qwen3-VL: of all frames."""
    max_pixels: int
    """Largest frame area after resizing (``size.longest_edge``); Qwen3-VL: of all frames."""
    patch_size: int
    """Side of a patch, in pixels."""
    image_mean: tuple[float, float, float]
    """Per-channel mean (of values in [0, 1])."""
    image_std: tuple[float, float, float]
    """Per-channel standard deviation."""
    temporal_patch_size: int = 2
    """Frames per patch; the frame count is padded to a multiple by repeating the last."""
    merge_size: int = 2
    """Side of the square of patches that becomes one language token."""
    cap_pixels_per_frame: bool = False
    """Bound the frames' pixels by ``max_video_tokens`` as qwen-vl-utils does (transformers'
    default is off, with a warning that it will turn on)."""
    max_video_tokens: int = 0
    """The budget ``cap_pixels_per_frame`` uses (Qwen2.5-VL: of the video; Qwen3-VL: per frame)."""
    min_frames: int = 4
    """Fewest frames a rate sampling keeps."""
    max_frames: int = 768
    """Most frames a sampling keeps."""

    @classmethod
    def from_config(cls, config: dict[str, Any], family: str) -> "VideoProcessing":
        """Read a ``video_preprocessor_config.json`` (or ``preprocessor_config.json``) dict.

        Keys the file lacks take the family's video processor defaults. The pixel bounds are
        ``size``'s ``shortest_edge`` and ``longest_edge``; Qwen2.5-VL's processor also reads
        ``min_pixels`` and ``max_pixels`` (first), Qwen3-VL's does not.

        Raises:
            VideoError: a family without videos.
        """
        if family not in _DEFAULTS:
            raise VideoError(f"{family} models take no video (videos: {VIDEO_FAMILIES})")
        min_pixels, max_pixels, patch, mean, std, budget = _DEFAULTS[family]
        size = dict(config.get("size") or {})
        if family == "qwen2_5_vl":  # Qwen2VLVideoProcessor reads these over size; Qwen3's not
            for key, name in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                size[name] = config.get(key) or size.get(name)
        return cls(
            family=family,
            min_pixels=int(size.get("shortest_edge") or min_pixels),
            max_pixels=int(size.get("longest_edge") or max_pixels),
            patch_size=int(config.get("patch_size", patch)),
            image_mean=tuple(config.get("image_mean", mean)),
            image_std=tuple(config.get("image_std", std)),
            temporal_patch_size=int(config.get("temporal_patch_size", 2)),
            merge_size=int(config.get("merge_size", 2)),
            cap_pixels_per_frame=bool(config.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(config.get("max_video_tokens") or budget),
            min_frames=int(config.get("min_frames", 4)),
            max_frames=int(config.get("max_frames", 768)),
        )

    @property
    def factor(self) -> int:
        """What each resized side is a multiple of: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    def resized_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The size each of ``frames`` frames of ``height x width`` is resized to.

        Raises:
            VideoError: an empty frame, or sides more than ``MAX_ASPECT_RATIO`` apart.
        """
        if min(height, width) <= 0:
            raise VideoError(f"a frame of {width}x{height} pixels is empty")
        max_pixels, factor = self.max_pixels, self.factor
        if self.family == "qwen3_vl":
            if self.cap_pixels_per_frame:
                per_frame = min(self.max_video_tokens * factor**2, max_pixels // frames)
                max_pixels = max(per_frame, int(self.min_pixels * 1.05)) * frames
            return _smart_resize_frames(
                frames, height, width, self.temporal_patch_size, factor, self.min_pixels, max_pixels
            )
        if self.cap_pixels_per_frame:
            total = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(
                min(max_pixels, total * self.temporal_patch_size // frames),
                int(self.min_pixels * 1.05),
            )
        return smart_resize(height, width, factor, self.min_pixels, max_pixels)

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """``(frame pairs, patch rows, patch columns)`` of a video (before resizing)."""
        resized_height, resized_width = self.resized_size(frames, height, width)
        pairs = -(-frames // self.temporal_patch_size)
        return pairs, resized_height // self.patch_size, resized_width // self.patch_size

    def num_tokens(self, grid: Sequence[int]) -> int:
        """Language tokens of a video of this grid."""
        pairs, rows, columns = grid
        return pairs * rows * columns // self.merge_size**2

    def sample(
        self, total: int, fps: float, num_frames: int | None = None, rate: float | None = None
    ) -> list[int]:
        """The indices of the frames kept, by the family's video processor's rule.

        Args:
            total: frames given.
            fps: their rate.
            num_frames: keep this many (Qwen2.5-VL rounds it to a multiple of
                ``temporal_patch_size``).
            rate: keep this many per second (within ``min_frames`` and ``max_frames``; at
                most ``total``). Neither: every frame.

        Raises:
            VideoError: both given, or more frames asked than given.
        """
        if num_frames is not None and rate is not None:
            raise VideoError("a video takes num_frames or sample_fps, not both")
        if num_frames is None and rate is None:
            return list(range(total))
        pairs = self.temporal_patch_size
        if self.family == "qwen3_vl":
            if num_frames is None:
                num_frames = int(total / fps * rate)
                num_frames = min(max(num_frames, self.min_frames), self.max_frames, total)
            if num_frames > total:
                raise VideoError(f"num_frames {num_frames} is more than the {total} frames")
            return np.linspace(0, total - 1, num_frames).round().astype(int).tolist()
        if num_frames is not None:
            num_frames = round(num_frames / pairs) * pairs
        else:
            most = math.floor(min(self.max_frames, total) / pairs) * pairs
            wanted = min(max(total / fps * rate, self.min_frames), most, total)
            num_frames = math.floor(wanted / pairs) * pairs
        if num_frames > total or num_frames <= 0:
            raise VideoError(f"{num_frames} frames cannot be sampled from the {total} frames")
        return torch.arange(0, total, total / num_frames).int().tolist()

    def second_per_grid(self, indices: Sequence[int], total: int, fps: float) -> float:
        """Seconds per frame pair (Qwen2.5-VL's ``second_per_grid_ts``) of the kept frames."""
        return self.temporal_patch_size / (len(indices) / total * fps)

    def timestamps(self, indices: Sequence[int], fps: float) -> list[float]:
        """Each frame pair's time in seconds: the mean of its first and last frame's."""
        indices = list(indices)
        pairs = self.temporal_patch_size
        indices += [indices[-1]] * (-len(indices) % pairs)
        times = [index / fps for index in indices]
        return [(times[i] + times[i + pairs - 1]) / 2 for i in range(0, len(times), pairs)]

    def text(self, grid: Sequence[int], indices: Sequence[int], fps: float) -> str:
        """What the processor writes for a video in place of the template's start, pad, end.

        Qwen2.5-VL: start, one pad per token, end. Qwen3-VL: per frame pair its timestamp,
        then start, its pads, end.
        """
        pairs, rows, columns = grid
        per_pair = rows * columns // self.merge_size**2
        if self.family != "qwen3_vl":
            return VIDEO_START + VIDEO_PAD * (pairs * per_pair) + VIDEO_END
        return "".join(
            f"<{time:.1f} seconds>{VIDEO_START}{VIDEO_PAD * per_pair}{VIDEO_END}"
            for time in self.timestamps(indices, fps)
        )

    def __call__(self, frames: Sequence[Image.Image]) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Patches of one video.

        Args:
            frames: its frames (RGB pillow images of one size), in order.

        Returns:
            ``(pixel_values_videos, grid)``: float32 ``[patches, channels *
            temporal_patch_size * patch_size**2]`` and ``(frame pairs, patch rows, columns)``.
        """
        # [frames, 3, H, W] viewed from the stacked [frames, H, W, 3] bytes (channels last:
        # torch's uint8 resize is fastest so, and gives the same bytes as on a contiguous copy).
        stacked = np.stack([np.asarray(frame) for frame in frames])
        data = torch.from_numpy(stacked).permute(0, 3, 1, 2)
        height, width = self.resized_size(len(frames), data.shape[2], data.shape[3])
        if (height, width) != tuple(data.shape[2:]):
            data = F.interpolate(
                data, size=[height, width], mode="bicubic", align_corners=False, antialias=True
            )
        if pad := -len(frames) % self.temporal_patch_size:
            data = torch.cat((data, data[-1:].expand(pad, -1, -1, -1)))
        return _patches(data, self)


def _smart_resize_frames(
    frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Qwen3-VL's video ``smart_resize``: the area of all frames bounded, small sides grown."""
    if frames < temporal_factor:
        raise VideoError(
            f"a Qwen3-VL video needs at least {temporal_factor} frames (temporal_patch_size), "
            f"got {frames}"
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise VideoError(
            f"frames of {width}x{height} pixels have an aspect ratio over {MAX_ASPECT_RATIO}"
        )
    new_height, new_width = round(height / factor) * factor, round(width / factor) * factor
    new_frames = round(frames / temporal_factor) * temporal_factor
    if new_frames * new_height * new_width > max_pixels:
        shrink = math.sqrt(frames * height * width / max_pixels)
        new_height = max(factor, math.floor(height / shrink / factor) * factor)
        new_width = max(factor, math.floor(width / shrink / factor) * factor)
    elif new_frames * new_height * new_width < min_pixels:
        grow = math.sqrt(min_pixels / (frames * height * width))
        new_height = math.ceil(height * grow / factor) * factor
        new_width = math.ceil(width * grow / factor) * factor
    return new_height, new_width


def _patches(
    data: torch.Tensor, processing: VideoProcessing
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Normalised, flattened block-major patches of resized ``uint8 [frames, C, H, W]``.

    The frame count is a multiple of the pair. The bytes are moved into patch order and made float32 in one copy, then normalised in
    place: ``(x - 255 * mean) / (255 * std)``, the same float32 operations on each value as
    transformers' fused rescale and normalise before its patchify.
    """
    frames, channels, height, width = data.shape
    side, merge, pair = processing.patch_size, processing.merge_size, processing.temporal_patch_size
    pairs, rows, columns = frames // pair, height // side, width // side
    blocks = data.view(
        pairs, pair, channels, rows // merge, merge, side, columns // merge, merge, side
    )
    # -> pair, block row, block column, row in block, column in block, channel, frame, y, x
    blocks = blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixels = torch.empty(blocks.shape, dtype=torch.float32)
    pixels.copy_(blocks)
    at_channel = (channels, 1, 1, 1)
    pixels.sub_((torch.tensor(processing.image_mean) * 255.0).view(at_channel))
    pixels.div_((torch.tensor(processing.image_std) * 255.0).view(at_channel))
    flat = pixels.view(pairs * rows * columns, channels * pair * side**2)
    return flat, (pairs, rows, columns)


def frame_files(source: str | os.PathLike | Sequence[str], base: str | None = None) -> list[str]:
    """A video's frame files: a list as given, or a folder's frame images in name order.

    Args:
        source: the video part's value: a list of frame paths or a folder.
        base: folder relative paths are read from (None: the working directory).

    Raises:
        VideoError: a video file (not decoded), a missing folder, no frames.
    """

    def resolve(path: str | os.PathLike) -> Path:
        path = Path(path)
        return path if path.is_absolute() or base is None else Path(base) / path

    if isinstance(source, str | os.PathLike):
        folder = resolve(source)
        if folder.suffix.lower() in VIDEO_FILE_SUFFIXES:
            raise VideoError(
                f"{folder}: video files are not decoded; give the video's frames as a list of "
                "image files or a folder of them"
            )
        if not folder.is_dir():
            raise VideoError(f"{folder}: not a folder of frames (video frames not found)")
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
        if not files:
            raise VideoError(f"{folder}: the folder holds no frame images (zero frames)")
        return [str(p) for p in files]
    frames = list(source)
    if not frames:
        raise VideoError("the video lists zero frames")
    if not all(isinstance(frame, str | os.PathLike) for frame in frames):
        raise VideoError("a video's frames must be image file paths")
    return [str(resolve(frame)) for frame in frames]


def open_frames(
    files: Sequence[str], max_image_pixels: int, indices: Sequence[int] | None = None
) -> list[Image.Image]:
    """Read a video's frames (those at ``indices``), oriented and RGB, all of one size.

    Raises:
        VideoError: a missing, unreadable, truncated, empty or too large frame, or frames of
            different sizes.
    """
    chosen = [files[index] for index in indices] if indices is not None else list(files)
    frames = []
    for path in chosen:
        try:
            frame = open_image(path, max_image_pixels).convert("RGB")  # upright
        except ImageError as error:
            raise VideoError(f"video frame {error}") from None
        if frames and frame.size != frames[0].size:
            raise VideoError(
                f"{path}: a frame of {frame.width}x{frame.height} pixels in a video whose frames "
                f"are {frames[0].width}x{frames[0].height}"
            )
        frames.append(frame)
    return frames
