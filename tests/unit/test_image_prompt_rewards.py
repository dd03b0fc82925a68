"""A GRPO prompt's images reach the rewards: ``row["prompt_images"]`` (``PROMPT_IMAGES``).

Each row with images lists their local files in the prompt's order: a file named in content
parts or in the ``images`` column (relative to the data file) by its absolute path, an inline
``data:`` image by its copy in the image cache; each opens to the pixels the model was given.
A text prompt's row is as read; a row that already has the column is one line naming it.
"""

import base64
import io
import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from tunelab._paths import assets_dir
from tunelab.data import load_tokenizer, prompt_dataset
from tunelab.data.image_sources import ImageFetch
from tunelab.data.prompts import PROMPT_IMAGES
from tunelab.errors import DataError

IMAGES = assets_dir() / "tiny_vl" / "images"
QUESTION = "What colour is the shape?"


def _inline(path):
    buffer = io.BytesIO()
    Image.open(path).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def prompt_rows(folder):
    """Four prompts: a file by content part, one by the images column (relative), an inline
    image with a file, and a text prompt; each row's ``answer`` is its first image's colour."""
    (folder / "images").mkdir(exist_ok=True)
    shutil.copy(IMAGES / "blue_square_1.png", folder / "images" / "blue.png")
    red = str(IMAGES / "red_circle_0.png")
    parts = [{"type": "image", "image": red}, {"type": "text", "text": QUESTION}]
    two = [
        {"type": "image", "image": _inline(IMAGES / "green_circle_0.png")},
        {"type": "image", "image": red},
        {"type": "text", "text": QUESTION},
    ]
    return [
        {"prompt": [{"role": "user", "content": parts}], "answer": "red"},
        {"prompt": f"<image>{QUESTION}", "images": ["images/blue.png"], "answer": "blue"},
        {"prompt": [{"role": "user", "content": two}], "answer": "green"},
        {"prompt": "Say red.", "answer": "red"},
    ], [[red], [str(folder / "images" / "blue.png")], [None, red], None]


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def colour(path):
    """The colour of the shape in one of the tiny model's images (on white)."""
    pixels = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3).astype(int)
    shape = pixels[pixels.sum(axis=1) < 600]
    return ("red", "green", "blue")[int(shape.mean(axis=0).argmax())]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(assets_dir() / "tiny_vl", max_seq_len=128)


def test_rows_carry_their_images_local_files(tokenizer, tmp_path, monkeypatch):
    rows, expected = prompt_rows(tmp_path)
    file = _write(tmp_path / "prompts.jsonl", rows)
    monkeypatch.chdir(tmp_path.parent)  # relative paths are the data file's folder's
    dataset = prompt_dataset(tokenizer, source="json", data_files=file)
    for row, source, files in zip(dataset.rows, rows, expected, strict=True):
        if files is None:
            assert row == source  # a text prompt's row is as read
            continue
        assert {k: v for k, v in row.items() if k != PROMPT_IMAGES} == source
        got = row[PROMPT_IMAGES]
        assert len(got) == len(files) and all(os.path.isabs(path) for path in got)
        for path, want in zip(got, files, strict=True):
            assert os.path.isfile(path)
            if want is not None:
                assert path == want
            else:  # the inline image's copy in the image cache, named by the URI's sha256
                assert path == str(
                    ImageFetch().cached_file(source["prompt"][0]["content"][0]["image"])
                )
        assert colour(got[0]) == row["answer"]


def test_a_row_with_the_column_already_is_one_line(tokenizer, tmp_path):
    rows, _ = prompt_rows(tmp_path)
    rows[1][PROMPT_IMAGES] = ["mine.png"]
    file = _write(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(DataError) as caught:
        prompt_dataset(tokenizer, source="json", data_files=file)
    message = str(caught.value)
    assert "\n" not in message
    assert f"{file}:2: row 1 (0-based), column 'prompt_images'" in message
