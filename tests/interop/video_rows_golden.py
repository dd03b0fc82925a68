"""Chat rows with videos as transformers' processors make them: the fixtures and their record.

``tests/interop/test_video_rows_hf.py`` compares tunelab's ids, trained masks, grids, time axes
and pixel values of video rows with what transformers 5.25's ``Qwen2_5_VLProcessor`` and
``Qwen3VLProcessor`` (``apply_chat_template`` with the video processors) gave on the same
files. Those video processors import torchvision, which the test environment does not have
(PyPI's torchvision wheel for torch 2.13 is a CUDA build whose operators fail to load beside
the CPU torch: ``operator torchvision::nms does not exist``), so their results are recorded in
``video_rows_golden.json`` by this script, run by hand where torchvision imports::

    python -m tests.interop.video_rows_golden   # writes tests/interop/video_rows_golden.json

Pixel values are recorded as the sha256 of their float32 bytes (equal bytes, or the test
fails), with their shape and sum to read a difference by.

Everything the record depends on is made here from fixed numbers: a byte-level BPE trained on a
fixed text, Qwen-style chat templates that write ``<|vision_start|><|video_pad|><|vision_end|>``
for a video part, and frames of seeded noise.
"""

import hashlib
import json
from pathlib import Path

import numpy as np
from PIL import Image

from tests.interop.vl_checks import write_chat_tokenizer

GOLDEN = Path(__file__).with_suffix(".json")
# Qwen2.5-VL's and Qwen3-VL's templates write images and videos alike; the assistant's text
# inside {% generation %} blocks, so transformers' return_assistant_tokens_mask gives the
# trained tokens.
TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% elif message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Each family's video and image settings, pixel bounds made small.
SETTINGS = {
    "qwen2_5_vl": {
        "video": {
            "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 6},
            "patch_size": 14,
        },
        "image": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16, "patch_size": 14},
    },
    "qwen3_vl": {
        "video": {
            "size": {"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 20},
            "patch_size": 16,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
        "image": {
            "size": {"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 12},
            "patch_size": 16,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    },
}
# name: (frames, width, height, seed)
VIDEOS = {"clip": (4, 60, 45, 1), "odd": (3, 37, 70, 2), "long": (6, 50, 50, 3)}
FPS = {"clip": 2.0, "odd": None, "long": 4.0}  # None: no fps given (transformers' 24)


def make_folder(path: Path, family: str) -> Path:
    """Tokenizer, model type, processor settings, one image and the videos' frames."""
    text = "What happens in the video? <0.5 seconds> <1.0 seconds> A red ball rolls."
    write_chat_tokenizer(path, text, TEMPLATE)
    (path / "config.json").write_text(json.dumps({"model_type": family}))
    settings = SETTINGS[family]
    (path / "preprocessor_config.json").write_text(json.dumps(settings["image"]))
    (path / "video_preprocessor_config.json").write_text(json.dumps(settings["video"]))
    Image.new("RGB", (40, 30), (255, 0, 0)).save(path / "red.png")
    for name, (frames, width, height, seed) in VIDEOS.items():
        noise = np.random.RandomState(seed).randint(0, 256, (frames, height, width, 3))
        (path / name).mkdir()
        for index, frame in enumerate(noise.astype(np.uint8)):
            Image.fromarray(frame).save(path / name / f"{index:03d}.png")
    return path


def frames(folder: Path, name: str) -> list[str]:
    """A video's frame files, in order."""
    return [str(folder / name / f"{index:03d}.png") for index in range(VIDEOS[name][0])]


def video_part(folder: Path, name: str) -> dict:
    """tunelab's content part for a video (its fps when the case gives one)."""
    part = {"type": "video", "video": frames(folder, name)}
    if FPS[name] is not None:
        part["fps"] = FPS[name]
    return part


def conversations(folder: Path) -> dict[str, list[dict]]:
    """The conversations compared, by name."""
    text = {"type": "text", "text": "What happens in the video?"}
    return {
        "one video": [
            {"role": "user", "content": [video_part(folder, "clip"), text]},
            {"role": "assistant", "content": "A red ball rolls."},
        ],
        "an image and two videos": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": str(folder / "red.png")},
                    video_part(folder, "odd"),
                    text,
                    video_part(folder, "long"),
                ],
            },
            {"role": "assistant", "content": "A red ball rolls."},
        ],
    }


def digest(values) -> dict:
    """A float32 tensor's record: sha256 of its bytes, shape and sum."""
    data = values.float().contiguous().numpy()
    return {
        "sha256": hashlib.sha256(data.tobytes()).hexdigest(),
        "shape": list(data.shape),
        "sum": float(data.astype(np.float64).sum()),
    }


def transformers_record(folder: Path, family: str, messages: list[dict]) -> dict:
    """What transformers' processor makes of ``messages`` (needs torchvision)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    settings = SETTINGS[family]
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    if family == "qwen3_vl":
        processor = transformers.Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessorPil(**settings["image"]),
            video_processor=transformers.Qwen3VLVideoProcessor(
                **settings["video"], cap_pixels_per_frame=False
            ),
            tokenizer=tokenizer,
            chat_template=TEMPLATE,
        )
    else:
        processor = transformers.Qwen2_5_VLProcessor(
            image_processor=Qwen2VLImageProcessorPil(**settings["image"]),
            video_processor=transformers.Qwen2VLVideoProcessor(
                **settings["video"], cap_pixels_per_frame=False
            ),
            tokenizer=tokenizer,
            chat_template=TEMPLATE,
        )
    metadata, hf_messages = [], []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] == "video":
                    count = len(part["video"])
                    fps = part.get("fps")
                    metadata.append(
                        {
                            "total_num_frames": count,
                            "fps": fps,
                            "frames_indices": list(range(count)),
                        }
                    )
                    # Decoded here: transformers' own path decodes with torchvision.io, whose
                    # extension is the part that fails to load (PNG frames: the same bytes).
                    decoded = [Image.open(file).convert("RGB") for file in part["video"]]
                    part = {"type": "video", "video": decoded}
                parts.append(part)
            content = parts
        hf_messages.append({**message, "content": content})
    out = processor.apply_chat_template(
        hf_messages,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        return_tensors="pt",
        do_sample_frames=False,
        video_metadata=metadata,
    )
    ids = out["input_ids"][0].tolist()
    return {
        "ids": ids,
        "trained": out["assistant_masks"][0].tolist(),
        "video_grid_thw": out["video_grid_thw"].tolist(),
        "second_per_grid_ts": [float(x) for x in out.get("second_per_grid_ts", [])],
        "pixel_values_videos": digest(out["pixel_values_videos"]),
        "text": tokenizer.decode(ids),
    }


def main() -> None:
    import tempfile

    record = {}
    for family in sorted(SETTINGS):
        with tempfile.TemporaryDirectory() as tmp:
            folder = make_folder(Path(tmp), family)
            for name, messages in conversations(folder).items():
                record[f"{family}: {name}"] = transformers_record(folder, family, messages)
    GOLDEN.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
