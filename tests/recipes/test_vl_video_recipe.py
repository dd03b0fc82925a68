"""LoRA SFT on chat rows with videos through the real ``tunelab run``, for Qwen2.5-VL and
Qwen3-VL: two processes equal one process with twice the accumulation, and a run killed after
step 2 and resumed on two processes gives the same losses and exports bit for bit.

The embedded tiny models (``tiny_vl``, ``tiny_qwen3_vl``) are copied with a chat template that
writes videos as the Qwen templates do; the rows are generated frames: a list of frame files
with their fps, a folder of frames, an odd frame count (the last frame repeated), and an image
and a video in one row. Each batch feeds ``pixel_values_videos`` through the tower and, for
Qwen2.5-VL, ``second_per_grid_ts`` into the temporal positions.
"""

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    losses_by_step,
    tunelab_run,
)
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow
STEPS = 3
ROWS = 12  # 3 steps of 4 rows (2 processes x 2, or 1 x 2 x accumulation 2)
CONFIGS = {
    "qwen2_5_vl": ("tiny/vl_lora", "tiny_vl"),
    "qwen3_vl": ("tiny/qwen3_vl_lora", "tiny_qwen3_vl"),
}
IMAGE_PART = "{% if part['type'] == 'image' or 'image' in part %}"
VIDEO_PART = "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"


def model_with_video_template(folder, asset):
    """A copy of an embedded tiny model whose chat template writes videos, and a video config."""
    shutil.copytree(assets_dir() / asset, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template = config["chat_template"]
    image_branch = template[template.index(IMAGE_PART) :].split("{% elif", 1)[0]
    config["chat_template"] = template.replace(image_branch, image_branch + VIDEO_PART, 1)
    assert VIDEO_PART in config["chat_template"]
    config_path.write_text(json.dumps(config))
    # Small frames: the video processors' default pixel bounds would make ~100 tokens a pair.
    image = json.loads((folder / "preprocessor_config.json").read_text())
    bounds = {"shortest_edge": image["min_pixels"], "longest_edge": image["max_pixels"]}
    video = {**image, "size": bounds}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))
    return folder


def _frames(folder, name, count, colour, size=(56, 56)):
    (folder / name).mkdir()
    noise = np.random.RandomState(count).randint(0, 40, (count, size[1], size[0], 3))
    files = []
    for index, frame in enumerate(np.clip(noise + np.array(colour), 0, 255).astype(np.uint8)):
        path = folder / name / f"{index:02d}.png"
        Image.fromarray(frame).save(path)
        files.append(f"{name}/{path.name}")
    return files


def video_rows(folder):
    """``ROWS`` chat rows with generated videos (and an image in every fourth), as a jsonl."""
    colours = {"Red": (200, 20, 20), "Green": (20, 200, 20), "Blue": (20, 20, 200)}
    rows = []
    for number in range(ROWS):
        answer, colour = list(colours.items())[number % 3]
        frames = _frames(folder, f"v{number}", 3 + number % 3, colour)
        video = {"type": "video", "video": frames, "fps": 2.0}
        if number % 4 == 1:  # a folder of frames, no fps given
            video = {"type": "video", "video": f"v{number}"}
        content = [video, {"type": "text", "text": "What colour is the ball?"}]
        if number % 4 == 3:
            content.insert(
                0, {"type": "image", "image": str(assets_dir() / "tiny_vl/images/red_circle_0.png")}
            )
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": content},
                    {"role": "assistant", "content": f"{answer}."},
                ]
            }
        )
    path = folder / "videos.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    config, asset = CONFIGS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model = model_with_video_template(root / "model", asset)
    return config, model, video_rows(root)


def _run(family, out, nproc, accumulation, *extra):
    config, model, data = family
    return tunelab_run(
        "lora_finetune_distributed", config, f"output_dir={out}", f"model.path={model}",
        f"dataset.data_files={data}", "schedule.epochs=1", f"schedule.max_steps_per_epoch={STEPS}",
        "lr_scheduler.num_warmup_steps=0", "schedule.batch_size=2", "checkpoint.save_every_n_steps=2",
        "checkpoint.keep_last_n_checkpoints=null",
        f"schedule.gradient_accumulation_steps={accumulation}", *extra, nproc=nproc,
    )  # fmt: skip


@pytest.fixture(scope="module")
def two_processes(family, tmp_path_factory):
    out = tmp_path_factory.mktemp("video_2p") / "run"
    _run(family, out, nproc=2, accumulation=1)
    return out


def test_every_row_holds_its_video(family, tmp_path):
    from tunelab.data.image_dataset import image_chat_dataset
    from tunelab.data.tokenizer import load_tokenizer

    _, model, data = family
    tokenizer = load_tokenizer(model, max_seq_len=128)
    build = dict(source="json", data_files=str(data), cache_dir=str(tmp_path))
    dataset = image_chat_dataset(tokenizer, max_seq_len=128, **build)
    assert len(dataset) == ROWS
    assert all(len(dataset[i]["videos"]) == 1 for i in range(ROWS))
    assert [len(dataset[i]["images"]) for i in range(ROWS)] == [0, 0, 0, 1] * (ROWS // 4)


def test_two_processes_equal_one_with_twice_the_accumulation(family, two_processes, tmp_path):
    _run(family, tmp_path / "1p", nproc=1, accumulation=2)
    two, one = losses_by_step(two_processes), losses_by_step(tmp_path / "1p")
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step in two:
        assert abs(two[step] - one[step]) <= 1e-5, (step, two[step], one[step])


def test_exact_resume_on_two_processes(family, two_processes, tmp_path):
    out = interrupted_copy(two_processes, tmp_path / "run", after_step=2)
    _run(family, out, 2, 1, "checkpoint.resume_from_checkpoint=true")
    resumed, reference = losses_by_step(out), losses_by_step(two_processes)
    assert sorted(resumed) == [3] and resumed[3] == reference[3], (resumed, reference)
    assert_same_exports(out, two_processes)
