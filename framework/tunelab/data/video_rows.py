"""Chat rows with videos: reading video parts, their text, and the batch's video tensors.

A video is named in a message's content as transformers' part ``{"type": "video", "video":
[frame files]}`` (or ``"path"``), the frames a list of image files or a folder of them
(``tunelab.data.videos``). Optional keys of the part: ``fps``, the rate of the frames given
(default 24, transformers' for frames without metadata), and ``num_frames`` or
``sample_fps`` to keep only some frames by the family's sampling rule.

The chat template writes ``<|vision_start|><|video_pad|><|vision_end|>`` for each video part;
that text is replaced, before tokenising, with what the family's processor writes
(``VideoProcessing.text``: Qwen2.5-VL one pad per video token, Qwen3-VL each frame pair after
its timestamp), so ids and trained masks equal transformers' ``apply_chat_template`` with the
processor. Video tokens are never trained.

Every frame is opened while the rows are tokenised: a missing, unreadable or truncated frame,
frames of different sizes, zero frames, a video file (not decoded) and a video given to a model
without video input (text-only, Gemma 3) are each a ``BadRow``, reported with file and line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tunelab.data.rows import IGNORE_INDEX, BadRow
from tunelab.data.tokenizer import Tokenizer
from tunelab.data.videos import (
    DEFAULT_FPS,
    VIDEO_END,
    VIDEO_FAMILIES,
    VIDEO_PAD,
    VIDEO_START,
    VideoError,
    VideoProcessing,
    frame_files,
    open_frames,
)

VIDEO_COLUMNS = ("videos", "video_grids", "video_seconds")
"""A sample's video lists (per video: its frame files joined by newlines, its grid, its
seconds per frame pair), which a pack concatenates in document order."""
VIDEO_WRAPPER = VIDEO_START + VIDEO_PAD + VIDEO_END
"""What a Qwen chat template writes for a video part."""
VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"


@dataclass(frozen=True)
class VideoRef:
    """One video of a row: its kept frames, grid, time axis and the processor's text."""

    frames: tuple[str, ...]
    """The frame files kept, in order."""
    grid: tuple[int, int, int]
    """``(frame pairs, patch rows, patch columns)`` after resizing."""
    seconds: float
    """Seconds per frame pair (Qwen2.5-VL's ``second_per_grid_ts``)."""
    text: str
    """What replaces the template's video placeholder."""
    tokens: int
    """Its video tokens."""


def video_processing_for(tokenizer: Tokenizer) -> VideoProcessing | None:
    """The video preprocessing of the model the tokenizer belongs to, or None (no video).

    The family is ``config.json``'s ``model_type`` beside the tokenizer (a checkpoint folder);
    the settings are ``video_preprocessor_config.json``'s, else ``preprocessor_config.json``'s
    (as transformers reads them), the family's video processor defaults for keys neither has.
    """
    folder = Path(tokenizer.source).parent
    config_path = folder / "config.json"
    if not config_path.is_file():
        return None
    family = json.loads(config_path.read_text()).get("model_type")
    if family not in VIDEO_FAMILIES:
        return None
    for name in (VIDEO_PREPROCESSOR_CONFIG, "preprocessor_config.json"):
        if (folder / name).is_file():
            return VideoProcessing.from_config(json.loads((folder / name).read_text()), family)
    return None


def _video_source(part: Mapping[str, Any]) -> Any:
    for key in ("video", "path"):
        if part.get(key) is not None:
            return part[key]
    raise VideoError("a video part needs its frames under 'video' or 'path'")


def _number(part: Mapping[str, Any], key: str, kind: type) -> Any:
    value = part.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise VideoError(f"a video part's {key!r} must be a positive number, got {value!r}")
    return kind(value)


def read_video(
    part: Mapping[str, Any], processing: VideoProcessing, base: str | None, max_pixels: int
) -> VideoRef:
    """One video part read: its frames checked and sampled, its grid and text.

    Args:
        part: the content part.
        processing: the model's video preprocessing.
        base: folder relative frame paths are read from.
        max_pixels: the largest ``width * height`` a frame may declare.

    Raises:
        VideoError: a bad part or frame (one line).
    """
    files = frame_files(_video_source(part), base)
    fps = _number(part, "fps", float) or DEFAULT_FPS
    indices = processing.sample(
        len(files), fps, _number(part, "num_frames", int), _number(part, "sample_fps", float)
    )
    frames = open_frames(files, max_pixels, indices)
    grid = processing.grid(len(frames), frames[0].height, frames[0].width)
    return VideoRef(
        frames=tuple(files[index] for index in indices),
        grid=grid,
        seconds=processing.second_per_grid(indices, len(files), fps),
        text=processing.text(grid, indices, fps),
        tokens=processing.num_tokens(grid),
    )


def read_videos(
    messages: list[dict[str, Any]],
    column: str,
    processing: VideoProcessing | None,
    base: str | None,
    max_pixels: int,
) -> tuple[list[dict[str, Any]], list[VideoRef]]:
    """The messages with each video part made ``{"type": "video"}``, and the videos read.

    Raises:
        BadRow: a bad video, or videos for a model that takes none.
    """
    videos: list[VideoRef] = []
    out = []
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "video"):
                parts.append(part)
                continue
            if processing is None:
                raise BadRow(
                    column,
                    f"message {index}: the row has a video but the model takes none "
                    f"(videos: {', '.join(VIDEO_FAMILIES)})",
                )
            try:
                videos.append(read_video(part, processing, base, max_pixels))
            except VideoError as error:
                raise BadRow(column, f"message {index}: {error}") from None
            parts.append({"type": "video"})
        out.append({**message, "content": parts})
    return out, videos


def add_videos(
    sample: dict[str, Any],
    tokens: Sequence[int],
    videos: Sequence[VideoRef],
    tokenizer: Tokenizer,
    column: str,
    max_seq_len: int | None,
) -> dict[str, Any]:
    """``sample`` with the videos its tokens hold, their tokens untrained.

    Args:
        sample: a sample of ``tokens`` (cut to ``max_seq_len``).
        tokens: its ids before the cut.
        videos: the row's videos, in order.
        tokenizer: the tokenizer (the video token's id).
        column: the messages' column, for errors.
        max_seq_len: the cut.

    Raises:
        BadRow: the video tokens match no leading videos, or the cut falls in a video.
    """
    video_id = tokenizer.token_to_id(VIDEO_PAD)
    held = list(tokens).count(video_id) if video_id is not None else 0
    total, number = 0, 0
    while number < len(videos) and total < held:
        total += videos[number].tokens
        number += 1
    if total != held or (videos and video_id is None):
        raise BadRow(
            column,
            f"the sample holds {held} {VIDEO_PAD} tokens, which no leading videos of the row "
            f"add up to ({[video.tokens for video in videos]} each)",
        )
    if held and max_seq_len is not None and video_id in tokens[max_seq_len:]:
        raise BadRow(
            column,
            f"the sample is {len(tokens)} tokens with its videos; max_seq_len {max_seq_len} "
            "would cut a video",
        )
    kept = videos[:number]
    if kept:
        sample["labels"] = [
            IGNORE_INDEX if token == video_id else label
            for token, label in zip(sample["tokens"], sample["labels"], strict=True)
        ]
    sample["videos"] = ["\n".join(video.frames) for video in kept]
    sample["video_grids"] = [list(video.grid) for video in kept]
    sample["video_seconds"] = [video.seconds for video in kept]
    return sample


def collate_videos(
    batch: Sequence[Mapping[str, Any]], processing: VideoProcessing, max_pixels: int
) -> dict[str, torch.Tensor]:
    """The batch's videos read and cut into patches (in the data loader's workers).

    Returns:
        ``pixel_values_videos`` ``[patches, features]``, ``video_grid_thw`` ``[videos, 3]`` and
        ``second_per_grid_ts`` ``[videos]``, row after row; empty without videos.

    Raises:
        VideoError: a frame that cannot be read, or a grid other than the one its tokens were
            counted for (a frame changed after tokenising).
    """
    pixels, grids, seconds = [], [], []
    for item in batch:
        for files, expected, second in zip(
            item.get("videos") or [], item.get("video_grids") or [], item.get("video_seconds") or []
        ):
            frames = files.split("\n")
            values, grid = processing(open_frames(frames, max_pixels))
            if list(grid) != list(expected):
                raise VideoError(
                    f"{os.path.dirname(frames[0]) or '.'}: the video is now {list(grid)} patches, "
                    f"not the {list(expected)} its tokens were counted for (a frame changed "
                    "after tokenising)"
                )
            pixels.append(values)
            grids.append(grid)
            seconds.append(second)
    if not pixels:
        return {}
    return {
        "pixel_values_videos": torch.cat(pixels),
        "video_grid_thw": torch.tensor(grids, dtype=torch.long),
        "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32),
    }


def with_videos(
    pairs: Sequence[tuple[dict[str, Any], Sequence[int]]], videos: Sequence[VideoRef], rows: Any
) -> list[dict[str, Any]]:
    """A row's samples (each with its ids before the cut) with their videos (``add_videos``).

    Args:
        pairs: ``(sample, ids)`` of each sample of the row.
        videos: the row's videos.
        rows: the row function (``ImageChatRows``: its tokenizer, column and ``max_seq_len``).

    Raises:
        BadRow: as ``add_videos``, or a video that no sample holds (the template wrote fewer
            video placeholders than the row has videos).
    """
    samples = [
        add_videos(sample, tokens, videos, rows.tokenizer, rows.column, rows.max_seq_len)
        for sample, tokens in pairs
    ]
    placed = max((len(sample["videos"]) for sample in samples), default=0)
    if videos and placed < len(videos):
        raise BadRow(
            rows.column,
            f"the chat template wrote {placed} {VIDEO_WRAPPER} for {len(videos)} videos",
        )
    return samples


def refuse_videos(messages: Sequence[Mapping[str, Any]], column: str) -> None:
    """Refuse video parts where videos are not read (generation prompts).

    Raises:
        BadRow: a message holds a video part.
    """
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(part, Mapping) and part.get("type") == "video" for part in content
        ):
            raise BadRow(
                column, f"message {index}: videos in generation prompts are not read (SFT only)"
            )


def video_records(
    tokenizer: Tokenizer,
    item: Mapping[str, Any],
    processing: VideoProcessing,
    max_pixels: int,
    pixels: bool,
) -> list[dict[str, Any]]:
    """Each video of a sample for ``tunelab data preview``: frames, sizes, grid, tokens, span.

    Args:
        tokenizer: the tokenizer (the video token).
        item: a sample (``videos``, ``video_grids``, ``video_seconds`` beside its tokens).
        processing: the model's video preprocessing.
        max_pixels: the largest frame area.
        pixels: read the frames and add the pixel values' shape and the sha256 of their
            float32 bytes (as the training collate makes them).
    """
    import hashlib

    video_id = tokenizer.token_to_id(VIDEO_PAD)
    positions = [index for index, token in enumerate(item["tokens"]) if token == video_id]
    records, used = [], 0
    for files, grid, seconds in zip(item["videos"], item["video_grids"], item["video_seconds"]):
        frames = files.split("\n")
        count = processing.num_tokens(grid)
        span, used = positions[used : used + count], used + count
        first = open_frames(frames[:1], max_pixels)[0]
        record = {
            "frames": len(frames),
            "first_frame": frames[0],
            "size": [first.width, first.height],
            "resized": [grid[2] * processing.patch_size, grid[1] * processing.patch_size],
            "grid": list(grid),
            "second_per_grid": seconds,
            "tokens": count,
            "token_start": span[0] if span else None,
            "token_end": span[-1] + 1 if span else None,
        }
        if pixels:
            values, _ = processing(open_frames(frames, max_pixels))
            data = values.float().contiguous().numpy().tobytes()
            record["pixel_values_shape"] = list(values.shape)
            record["pixel_values_sha256"] = hashlib.sha256(data).hexdigest()
        records.append(record)
    return records


def video_lines(records: Sequence[Mapping[str, Any]]) -> str:
    """``video_records`` as preview lines."""
    return "".join(
        f"  video {index}: {record['frames']} frames from {record['first_frame']} "
        f"{record['size'][0]}x{record['size'][1]}, resized {record['resized'][0]}x"
        f"{record['resized'][1]}, grid {'x'.join(map(str, record['grid']))} "
        f"({record['second_per_grid']:.3g} s a frame pair): {record['tokens']} tokens at "
        f"positions {record['token_start']}-{record['token_end'] - 1}\n"
        for index, record in enumerate(records)
    )
