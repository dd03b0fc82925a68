"""``tunelab data preview``: the recipe's own dataset, shown without a model."""

import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tunelab._paths import assets_dir
from tunelab.cli import _data
from tunelab.config import instantiate, load_config, resolve_config_path
from tunelab.data import chat_dataset, load_tokenizer
from tunelab.errors import ConfigError

TINY = assets_dir() / "tiny"
QWEN = Path(__file__).resolve().parents[1] / "chat_templates" / "qwen2_5_instruct.jinja"
TUNELAB = str(Path(sys.executable).parent / "tunelab")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def preview_text(*overrides, rows=2, out=None):
    out = out or io.StringIO()
    _data.preview("tiny/chat_lora", list(overrides), rows, as_json=False, out=out)
    return out.getvalue()


def test_json_is_the_recipe_dataset():
    # The real command, against the dataset built in-process as the recipe builds it, and
    # against the builders called directly.
    override = f"tokenizer.chat_template={QWEN}"
    result = subprocess.run(
        [TUNELAB, "data", "preview", "tiny/chat_lora", override, "--rows", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 4

    cfg = load_config(str(resolve_config_path("tiny/chat_lora")), [override])
    tokenizer = instantiate(cfg.tokenizer)
    recipe_dataset = instantiate(cfg.dataset, tokenizer=tokenizer)
    direct_tokenizer = load_tokenizer(TINY, max_seq_len=256, chat_template=str(QWEN))
    direct = chat_dataset(
        direct_tokenizer, source="json", data_files=str(TINY / "chat.jsonl"), max_seq_len=256
    )
    for index, record in enumerate(records):
        assert set(record) == {"input_ids", "labels"}
        for dataset in (recipe_dataset, direct):
            assert record["input_ids"] == dataset[index]["tokens"]
            assert record["labels"] == dataset[index]["labels"]
        text = direct_tokenizer.decode(record["input_ids"], skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n")  # Qwen's template, not the tiny one
        assert any(label != -100 for label in record["labels"])


def test_text_marks_exactly_the_assistant_turns():
    text = preview_text(rows=2)
    assert text.splitlines()[0] == "tiny/chat_lora: 300 items"
    assert "--- item 0: 47 tokens, 11 trained ---" in text
    first = json.loads((TINY / "chat.jsonl").read_text().splitlines()[0])["messages"]
    answers = [m["content"] for m in first if m["role"] == "assistant"]
    marked = text.split("--- item 1")[0].split("[[")[1:]
    assert [piece.split("]]")[0] for piece in marked] == [f"{a}<|eot_id|>" for a in answers]
    assert "\x1b[" not in text


def test_terminal_gets_colour(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    text = preview_text(rows=1, out=Terminal())
    assert "\x1b[1;32mstar car bus cow<|eot_id|>\x1b[0m" in text and "[[" not in text
    monkeypatch.setenv("NO_COLOR", "1")
    assert "[[star car bus cow<|eot_id|>]]" in preview_text(rows=1, out=Terminal())


def test_preference_items_show_both_sides():
    out = io.StringIO()
    _data.preview("tiny/lora_dpo", [], 1, as_json=True, out=out)
    record = json.loads(out.getvalue())
    assert set(record) == {
        "chosen_input_ids",
        "chosen_labels",
        "rejected_input_ids",
        "rejected_labels",
    }
    out = io.StringIO()
    _data.preview("tiny/lora_dpo", [], 1, as_json=False, out=out)
    assert "--- item 0 chosen:" in out.getvalue() and "--- item 0 rejected:" in out.getvalue()


def test_config_without_dataset_is_one_error():
    with pytest.raises(ConfigError, match="has no dataset to preview"):
        _data.preview("tiny/generate", [], 1, as_json=True, out=io.StringIO())


def test_a_hub_dataset_while_the_hub_cannot_be_reached_fails_at_once_with_one_line(tmp_path):
    """Issue 38: `datasets` retried the hub for about 40 s, a line per retry (5 per request).

    The hub is an endpoint nothing listens on (as on a machine without network, on any
    machine); offline mode is not set: tunelab finds out itself.
    """
    import os
    import socket
    import time

    with socket.socket() as sock:  # a port nothing listens on once it is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    start = time.monotonic()
    result = subprocess.run(
        [TUNELAB, "data", "preview", "tiny/lora", "dataset.source=tunelab-tests/no-such-dataset",
         "~dataset.data_files"],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Retrying" not in output, output[-3000:]
    assert output.splitlines() == [result.stderr.strip()], output[-3000:]  # one line
    assert result.stderr.startswith("tunelab: error: cannot load dataset "), result.stderr
    assert f"http://127.0.0.1:{port} cannot be reached" in result.stderr, result.stderr
    # The retries alone slept 1 + 2 + 4 + 8 + 8 = 23 s; start-up takes 5-15 s here.
    assert elapsed < 23, elapsed


@pytest.fixture(scope="module")
def image_rows(tmp_path_factory):
    """Two rows of the tiny VL model's kind: two images (one resized) in one row, one in another."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("preview_images")
    sizes = {"wide.png": (70, 45), "square.png": (56, 56)}
    for index, (name, size) in enumerate(sizes.items()):
        Image.new("RGB", size, (40 * index, 200, 90)).save(folder / name)

    def row(*names):
        parts = [{"type": "image", "image": name} for name in names]
        user = {"role": "user", "content": [*parts, {"type": "text", "text": "Colours?"}]}
        return {"messages": [user, {"role": "assistant", "content": "Green."}]}

    rows = [row("wide.png", "square.png"), row("square.png")]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, sizes


def test_image_rows_show_each_image_its_tokens_and_pixels(image_rows):
    from tunelab.data.image_dataset import sft_collate

    folder, sizes = image_rows
    override = [f"dataset.data_files={folder / 'rows.jsonl'}"]
    out = io.StringIO()
    _data.preview("tiny/vl_lora", override, 2, as_json=True, out=out)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    tokenizer, dataset = _data.build_dataset("tiny/vl_lora", override)
    image_id = tokenizer.token_to_id("<|image_pad|>")
    collate = sft_collate(tokenizer)
    assert [len(record["images"]) for record in records] == [2, 1]
    for index, record in enumerate(records):
        item = dataset[index]
        assert record["input_ids"] == item["tokens"]
        # The pixels are the training collate's, image after image.
        batch = collate([item], tokenizer.pad_id)
        pixels = batch["pixel_values"].float()
        first = 0
        for image, grid in zip(record["images"], batch["image_grid_thw"].tolist()):
            name = Path(image["path"]).name
            assert image["size"] == list(sizes[name]) and image["grid"] == grid
            assert image["resized"] == [grid[2] * 14, grid[1] * 14]
            assert image["tokens"] == grid[0] * grid[1] * grid[2] // 4
            start, end = image["token_start"], image["token_end"]
            assert end - start == image["tokens"]
            ids = record["input_ids"]
            assert set(ids[start:end]) == {image_id} and image_id not in (ids[start - 1], ids[end])
            patches = pixels[first : first + grid[0] * grid[1] * grid[2]]
            first += len(patches)
            assert image["pixel_values_shape"] == list(patches.shape)
            digest = hashlib.sha256(patches.contiguous().numpy().tobytes()).hexdigest()
            assert image["pixel_values_sha256"] == digest
        assert first == len(pixels)
    # The two images of row 0 differ, so their checksums do.
    assert len({image["pixel_values_sha256"] for image in records[0]["images"]}) == 2
    wide, square = records[0]["images"]
    assert wide["resized"] != wide["size"]  # 70x45 is resized to whole patches

    out = io.StringIO()
    _data.preview("tiny/vl_lora", override, 1, as_json=False, out=out)
    text = out.getvalue()
    for image in (wide, square):
        assert (
            f"{image['size'][0]}x{image['size'][1]}, resized "
            f"{image['resized'][0]}x{image['resized'][1]}, grid "
            f"{'x'.join(map(str, image['grid']))}: {image['tokens']} tokens at positions "
            f"{image['token_start']}-{image['token_end'] - 1}"
        ) in text
    assert text.count("  image ") == 2 and "<|image_pad|><|image_pad|>" not in text
    assert f"<|image_pad|>x{wide['tokens']}<|vision_end|>" in text


def test_gemma3_image_rows_show_each_image_with_its_crops(image_rows, tmp_path):
    """Gemma 3 (tiny/gemma3_vl_lora, pan-and-scan switched on with 16-pixel crops): each image
    is its soft-token runs, one per piece (the image and each crop), and the pixel values of
    those pieces, as the training collate makes them."""
    import shutil

    from tunelab._paths import assets_dir
    from tunelab.data.image_dataset import sft_collate

    folder, sizes = image_rows
    model = tmp_path / "tiny_gemma3_vl"
    shutil.copytree(assets_dir() / "tiny_gemma3_vl", model)
    preprocessor = json.loads((model / "preprocessor_config.json").read_text())
    preprocessor |= {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}
    (model / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    override = [f"model.path={model}", f"dataset.data_files={folder / 'rows.jsonl'}"]
    override += ["dataset.max_seq_len=256", "tokenizer.max_seq_len=256"]
    out = io.StringIO()
    _data.preview("tiny/gemma3_vl_lora", override, 2, as_json=True, out=out)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    tokenizer, dataset = _data.build_dataset("tiny/gemma3_vl_lora", override)
    soft = tokenizer.token_to_id("<image_soft_token>")
    assert [len(record["images"]) for record in records] == [2, 1]
    for index, record in enumerate(records):
        pixels = sft_collate(tokenizer)([dataset[index]], tokenizer.pad_id)["pixel_values"]
        first = 0
        for image in record["images"]:
            pieces = image["grid"][0]
            # 70 x 45: ratio 1.56, 2 crops of 35 x 45 (each at least 16 pixels); 56 x 56: none.
            assert pieces == (3 if Path(image["path"]).name == "wide.png" else 1)
            assert image["tokens"] == 16 * pieces and image["resized"] == [64, 64]
            assert image["grid"][1:] == [8, 8]  # 8-pixel patches
            ids = record["input_ids"][image["token_start"] : image["token_end"]]
            assert ids.count(soft) == image["tokens"] and ids[0] == ids[-1] == soft
            assert image["pixel_values_shape"] == [pieces, 3, 64, 64]
            digest = hashlib.sha256(pixels[first : first + pieces].numpy().tobytes()).hexdigest()
            assert image["pixel_values_sha256"] == digest
            first += pieces
        assert first == len(pixels)
    out = io.StringIO()
    _data.preview("tiny/gemma3_vl_lora", override, 1, as_json=False, out=out)
    text = out.getvalue()
    assert text.count("  image ") == 2 and text.count("<image_soft_token>x16") == 4, text
