"""Chat rows with videos: ids, trained masks, grids, time axes and pixel values equal
transformers' processors; bad videos are one line with file and line.

The reference is ``video_rows_golden.json``: what transformers 5.25's ``Qwen2_5_VLProcessor``
and ``Qwen3VLProcessor`` (``apply_chat_template`` with ``Qwen2VLVideoProcessor`` and
``Qwen3VLVideoProcessor``) made of the same conversations and frames, recorded by
``tests/interop/video_rows_golden.py`` where torchvision imports (it does not here: see that
file). Pixel values must be equal to the byte (their sha256). A Qwen3-VL video's timestamps
come in the text; Qwen2.5-VL's ``second_per_grid_ts`` equal transformers' in float32.
"""

import json
from pathlib import Path

import pytest

from tests.interop import video_rows_golden as golden
from tunelab.data.image_dataset import image_chat_dataset, image_rows_per_file, sft_collate
from tunelab.data.rows import IGNORE_INDEX
from tunelab.data.tokenizer import load_tokenizer
from tunelab.data.video_rows import video_processing_for
from tunelab.data.videos import VideoProcessing
from tunelab.errors import DataError

RECORD = json.loads(golden.GOLDEN.read_text())


@pytest.fixture(scope="module", params=sorted(golden.SETTINGS))
def family_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, golden.make_folder(folder, request.param)


def _rows(folder: Path):
    tokenizer = load_tokenizer(folder, max_seq_len=512)
    rows_for, _, _ = image_rows_per_file(
        tokenizer,
        "test",
        column="messages",
        images_column="images",
        image_token="<|image_pad|>",
        max_image_pixels=100_000,
        max_seq_len=512,
        template_kwargs=None,
    )
    return tokenizer, rows_for(str(folder / "train.jsonl"))


@pytest.mark.parametrize("name", ["one video", "an image and two videos"])
def test_ids_masks_grids_and_pixels_equal_transformers(family_folder, name):
    family, folder = family_folder
    expected = RECORD[f"{family}: {name}"]
    tokenizer, rows = _rows(folder)
    (sample,) = rows({"messages": golden.conversations(folder)[name]})
    trained = [t if m else IGNORE_INDEX for t, m in zip(expected["ids"], expected["trained"])]
    assert sample["tokens"] == expected["ids"], tokenizer.decode(sample["tokens"])
    assert sample["labels"] == trained
    assert sample["video_grids"] == expected["video_grid_thw"]
    batch = sft_collate(tokenizer)([sample], pad_id=0)
    assert golden.digest(batch["pixel_values_videos"]) == expected["pixel_values_videos"]
    assert batch["video_grid_thw"].tolist() == expected["video_grid_thw"]
    if family == "qwen2_5_vl":
        assert batch["second_per_grid_ts"].tolist() == expected["second_per_grid_ts"]
    video = tokenizer.token_to_id("<|video_pad|>")
    tokens = int((batch["tokens"] == video).sum())
    assert tokens * 4 == batch["pixel_values_videos"].shape[0]  # 4 patches a token


def test_the_family_and_settings_are_read_beside_the_tokenizer(family_folder):
    family, folder = family_folder
    processing = video_processing_for(load_tokenizer(folder))
    settings = golden.SETTINGS[family]["video"]
    assert processing == VideoProcessing.from_config(settings, family)
    assert (
        processing.family == family and processing.min_pixels == settings["size"]["shortest_edge"]
    )


# (total frames, their fps, num_frames, sample_fps) -> transformers 5.25's sample_frames, by
# hand (``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor``, default min and max frames).
SAMPLED = {
    "qwen2_5_vl": {
        (10, 24.0, 5, None): [0, 2, 5, 7],
        (48, 24.0, None, 2.0): [0, 12, 24, 36],
        (100, 10.0, None, 1.0): list(range(0, 100, 10)),
        (9, 3.0, 6, None): [0, 1, 3, 4, 6, 7],
        (30, 30.0, None, 2.0): [0, 7, 15, 22],
    },
    "qwen3_vl": {
        (10, 24.0, 5, None): [0, 2, 4, 7, 9],
        (48, 24.0, None, 2.0): [0, 16, 31, 47],
        (100, 10.0, None, 1.0): [0, 11, 22, 33, 44, 55, 66, 77, 88, 99],
        (9, 3.0, 6, None): [0, 2, 3, 5, 6, 8],
        (30, 30.0, None, 2.0): [0, 10, 19, 29],
    },
}


def test_frames_sampled_by_the_family_rule(family_folder):
    """``num_frames`` and ``sample_fps`` keep the frames the family's ``sample_frames`` keeps
    (Qwen2-VL: whole frame pairs, ``total / n`` apart; Qwen3-VL: ``n`` spread over the range);
    neither keeps every frame."""
    family, _ = family_folder
    processing = VideoProcessing.from_config(golden.SETTINGS[family]["video"], family)
    for (total, fps, count, rate), expected in SAMPLED[family].items():
        assert processing.sample(total, fps, count, rate) == expected, (total, fps, count, rate)
    assert processing.sample(7, 24.0) == list(range(7))


def _write(folder: Path, rows: list[dict]) -> Path:
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def _video_row(frames) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "video", "video": frames}]},
            {"role": "assistant", "content": "A red ball rolls."},
        ]
    }


def test_bad_videos_are_one_line_with_file_and_line(family_folder, tmp_path):
    """A missing frame, an unreadable frame, zero frames, a video file and frames of two sizes
    each stop the build with one line naming the file, line and frame; skip_malformed skips
    them; the good row collates into the model's video inputs."""
    from PIL import Image

    family, folder = family_folder
    tokenizer = load_tokenizer(folder, max_seq_len=512)
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.png").write_bytes(b"not a png")
    Image.new("RGB", (20, 20)).save(tmp_path / "small.png")
    good = golden.frames(folder, "clip")
    cases = {
        "missing frame": (
            good[:1] + [str(tmp_path / "nope.png")],
            "nope.png: image file not found",
        ),
        "unreadable frame": (good[:1] + [str(tmp_path / "broken.png")], "not an image"),
        "zero frames": ([], "zero frames"),
        "empty folder": (str(tmp_path / "empty"), "holds no frame images (zero frames)"),
        "video file": (str(tmp_path / "clip.mp4"), "video files are not decoded"),
        "two sizes": (good[:1] + [str(tmp_path / "small.png")], "a frame of 20x20 pixels"),
    }
    for case, (frames, reason) in cases.items():
        data = _write(tmp_path, [_video_row(good), _video_row(frames)])
        build = dict(source="json", data_files=str(data), cache_dir=str(tmp_path / case))
        with pytest.raises(DataError) as caught:
            image_chat_dataset(tokenizer, **build)
        message = str(caught.value)
        assert message.startswith(f"{data}:2: row 1 (0-based)"), (case, message)
        assert reason in message and "\n" not in message, (case, message)
        dataset = image_chat_dataset(tokenizer, skip_malformed=True, **build)
        assert (len(dataset), dataset.num_skipped) == (1, 1), case
    batch = sft_collate(tokenizer)([dataset[0]], pad_id=0)
    assert batch["video_grid_thw"].shape == (1, 3)
    video = tokenizer.token_to_id("<|video_pad|>")
    assert int((batch["tokens"] == video).sum()) * 4 == batch["pixel_values_videos"].shape[0]
    assert bool((batch["labels"][batch["tokens"] == video] == IGNORE_INDEX).all())


def test_a_model_without_video_input_refuses_video_rows(family_folder, tmp_path):
    """Gemma 3 (and a text-only model) takes no video: one line naming the row."""
    import shutil

    _, folder = family_folder
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(folder / name, gemma / name)
    (gemma / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    data = _write(tmp_path, [_video_row(golden.frames(folder, "clip"))])
    build = dict(source="json", data_files=str(data), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError) as caught:
        image_chat_dataset(load_tokenizer(gemma, max_seq_len=512), **build)
    message = str(caught.value)
    assert message.startswith(f"{data}:1: row 0 (0-based)") and "\n" not in message
    assert "the row has a video but the model takes none" in message


def test_a_video_the_template_does_not_write_is_refused(family_folder):
    """A template without video parts would drop the video silently: refused in one line."""
    import dataclasses

    from tunelab.data.chat_template import ChatTemplate
    from tunelab.data.rows import BadRow

    _, folder = family_folder
    _, rows = _rows(folder)
    no_video = golden.TEMPLATE.replace("<|vision_start|><|video_pad|><|vision_end|>", "")
    rows = dataclasses.replace(rows, template=ChatTemplate(no_video, source="no video"))
    with pytest.raises(BadRow, match="the chat template wrote 0 .* for 1 videos"):
        rows(_video_row(golden.frames(folder, "clip")))


def test_data_preview_shows_each_video_its_tokens_and_pixels(family_folder, tmp_path):
    """``tunelab data preview``: each video's frames, sizes, grid, time axis and token span
    (text), and with ``--json`` the pixel values' shape and checksum, the collate's."""
    import io

    from tunelab.cli import _data

    family, folder = family_folder
    row = {"messages": golden.conversations(folder)["an image and two videos"]}
    data = _write(tmp_path, [row])
    overrides = [f"tokenizer.path={folder}", f"dataset.data_files={data}"]
    out = io.StringIO()
    _data.preview("tiny/vl_lora", overrides, 1, as_json=True, out=out)
    (record,) = [json.loads(line) for line in out.getvalue().splitlines()]
    expected = RECORD[f"{family}: an image and two videos"]
    assert record["input_ids"] == expected["ids"]
    videos = record["videos"]
    assert [video["grid"] for video in videos] == expected["video_grid_thw"]
    assert [video["frames"] for video in videos] == [3, 6]
    assert (
        sum(video["pixel_values_shape"][0] for video in videos)
        == (expected["pixel_values_videos"]["shape"][0])
    )
    video_id = load_tokenizer(folder).token_to_id("<|video_pad|>")
    for video in videos:
        span = record["input_ids"][video["token_start"] : video["token_end"]]
        assert span.count(video_id) == video["tokens"] > 0
    out = io.StringIO()
    _data.preview("tiny/vl_lora", overrides, 1, as_json=False, out=out)
    text = out.getvalue()
    assert text.count("  video ") == 2 and "<|video_pad|><|video_pad|>" not in text
    first = videos[0]
    assert (
        f"video 0: 3 frames from {first['first_frame']} 37x70, resized "
        f"{first['resized'][0]}x{first['resized'][1]}, grid {'x'.join(map(str, first['grid']))}"
    ) in text


# (family, cap_pixels_per_frame, max_video_tokens) -> {(frames, height, width): grid}: what
# transformers 5.25's video processors give at their default sizes, by hand (the pixel values of
# the 480 x 640 and 300 x 200 videos were equal to the byte too).
GRIDS = {
    ("qwen2_5_vl", False, None): {
        (16, 480, 640): (8, 34, 46),
        (64, 720, 1280): (32, 40, 72),
        (300, 1080, 1920): (150, 40, 72),
        (4, 50, 60): (2, 22, 26),
        (9, 200, 100): (5, 32, 16),
    },
    ("qwen2_5_vl", True, 1000): {(16, 480, 640): (8, 20, 26), (6, 300, 200): (3, 28, 20)},
    ("qwen3_vl", False, None): {
        (16, 480, 640): (8, 12, 16),
        (64, 720, 1280): (32, 4, 8),
        (300, 1080, 1920): (150, 2, 4),
        (4, 50, 60): (2, 12, 14),
        (9, 200, 100): (5, 12, 6),
    },
    ("qwen3_vl", True, None): {
        (16, 480, 640): (8, 20, 26),
        (64, 720, 1280): (32, 16, 30),
        (300, 1080, 1920): (150, 16, 30),
        (4, 50, 60): (2, 12, 14),
        (9, 200, 100): (5, 12, 6),
    },
    ("qwen3_vl", True, 1000): {(16, 480, 640): (8, 20, 26), (6, 300, 200): (3, 18, 12)},
}


@pytest.mark.parametrize("setting", sorted(GRIDS, key=str), ids=str)
def test_grids_at_the_processors_default_sizes(setting):
    """The pixel bounds of the family's video processor (Qwen3-VL's over all frames, small
    sides grown) and ``cap_pixels_per_frame``, by transformers' numbers."""
    family, cap, budget = setting
    config = {"cap_pixels_per_frame": cap} | ({"max_video_tokens": budget} if budget else {})
    processing = VideoProcessing.from_config(config, family)
    for (frames, height, width), grid in GRIDS[setting].items():
        assert processing.grid(frames, height, width) == grid, (frames, height, width)
