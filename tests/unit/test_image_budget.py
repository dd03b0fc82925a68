"""The pixel budget per sample (``max_pixels_per_sample``, ``tunelab.data.image_budget``).

Real rows with several images of different sizes on the tiny Qwen2.5-VL (``min_pixels`` 56 x 56,
``max_pixels`` 112 x 112, sides multiples of 28): a row over the budget has every image
downscaled by one factor, its grids, image tokens and pixels those of the processor given each
image's share as ``max_pixels`` (transformers' own processor too, where it is installed), and
the model trains on it; a row under the budget is unchanged; a row that cannot fit even at
28 x 28 an image is one line naming file, row and numbers, or skipped with ``skip_malformed``;
Gemma 3's fixed-size images are refused over the budget. GRPO prompts get the same budget.
"""

import json
import math
from dataclasses import replace

import pytest
import torch
from PIL import Image

from tunelab._paths import assets_dir
from tunelab.data import (
    image_chat_dataset,
    image_preference_dataset,
    load_tokenizer,
    preference_collate,
    prompt_dataset,
    sft_collate,
)
from tunelab.data.image_budget import budget_scale
from tunelab.data.image_dataset import image_processing_for
from tunelab.errors import DataError
from tunelab.losses import CrossEntropyLoss
from tunelab.models import load_pretrained
from tunelab.training.loop import batch_loss

TINY_VL = assets_dir() / "tiny_vl"
TINY_GEMMA3_VL = assets_dir() / "tiny_gemma3_vl"
# name -> (width, height): after the tiny model's own resize 84x84, 140x84 and 56x56.
SIZES = {"big.png": (300, 300), "wide.png": (420, 250), "small.png": (50, 50)}
QUESTION = "What is in the pictures?"


def _images(folder):
    for index, (name, size) in enumerate(SIZES.items()):
        colour = (40 * index, 255 - 60 * index, 90)
        image = Image.new("RGB", size, colour)
        image.paste((250, 10, 10), (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
        image.save(folder / name)


def _row(names, answer="Shapes."):
    parts = [{"type": "image", "image": name} for name in names]
    parts.append({"type": "text", "text": QUESTION})
    return {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": answer},
        ]
    }


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_VL, max_seq_len=256)


@pytest.fixture()
def data(tmp_path):
    _images(tmp_path)
    rows = [_row(list(SIZES)), _row(["small.png"], "Small."), _row(["small.png", "big.png"])]
    return _write(tmp_path / "train.jsonl", rows), tmp_path


def _build(tokenizer, file, tmp_path, **kwargs):
    return image_chat_dataset(
        tokenizer,
        source="json",
        data_files=file,
        max_seq_len=256,
        num_proc=1,
        cache_dir=str(tmp_path / "cache"),
        **kwargs,
    )


def _area(grid):
    return grid[1] * grid[2] * 14 * 14


def _shared(processing, names, budget, scale=None):
    """Each image's processor with its share of the budget as max_pixels (``budget_scale``)."""
    sizes = [(SIZES[name][1], SIZES[name][0]) for name in names]
    scale = budget_scale(processing, sizes, budget) if scale is None else scale
    out = []
    for height, width in sizes:
        own = processing.resized_size(height, width)
        share = math.floor(own[0] * own[1] * scale)
        out.append(replace(processing, max_pixels=share, min_pixels=min(share, 3136)))
    return out


def test_a_row_over_the_budget_is_downscaled_by_one_factor(tokenizer, data):
    file, folder = data
    plain = _build(tokenizer, file, folder)
    budget = 15_000  # the first row is 7056 + 11760 + 3136 = 21952 pixels after resizing
    fitted = _build(tokenizer, file, folder, max_pixels_per_sample=budget)
    processing = image_processing_for(tokenizer)
    image_token = tokenizer.token_to_id("<|image_pad|>")
    own = [_area(grid) for grid in plain[0]["image_grids"]]
    assert own == [7056, 11760, 3136]
    fitted_areas = [_area(grid) for grid in fitted[0]["image_grids"]]
    assert sum(fitted_areas) <= budget < sum(own)
    shared = _shared(processing, list(SIZES), budget)
    # The factor is the largest that fits: a little more and the images overflow the budget.
    sizes = [(height, width) for width, height in SIZES.values()]
    scale = budget_scale(processing, sizes, budget)
    more = [
        _area(each.grid(*size))
        for each, size in zip(_shared(processing, list(SIZES), budget, scale + 2**-31), sizes)
    ]
    assert sum(more) > budget
    for name, area, before, grid, each in zip(
        SIZES, fitted_areas, own, fitted[0]["image_grids"], shared, strict=True
    ):
        assert area < before
        # The processor's own resize with this image's share of the budget as max_pixels.
        width, height = SIZES[name]
        assert list(each.grid(height, width)) == grid
    # The image tokens shrink with the pixels; the text is the same.
    tokens = fitted[0]["tokens"]
    assert tokens.count(image_token) == sum(area // 28**2 for area in fitted_areas)
    text = [t for t in plain[0]["tokens"] if t != image_token]
    assert [t for t in tokens if t != image_token] == text
    # Rows under the budget are as without it.
    for index in (1, 2):
        assert fitted[index]["tokens"] == plain[index]["tokens"]
        assert fitted[index]["image_grids"] == plain[index]["image_grids"]


def test_the_collate_reads_the_downscaled_pixels_and_the_model_trains_on_them(tokenizer, data):
    file, folder = data
    budget = 15_000
    fitted = _build(tokenizer, file, folder, max_pixels_per_sample=budget)
    processing = image_processing_for(tokenizer)
    batch = sft_collate(tokenizer)([fitted[0], fitted[1]], pad_id=tokenizer.pad_id)
    grids = fitted[0]["image_grids"] + fitted[1]["image_grids"]
    assert batch["image_grid_thw"].tolist() == grids
    expected = []
    chosen = [*_shared(processing, list(SIZES), budget), processing]  # row 1 is under it
    for name, grid, each in zip([*SIZES, "small.png"], grids, chosen, strict=True):
        values, got = each(Image.open(folder / name))
        assert list(got) == grid
        expected.append(values)
    torch.testing.assert_close(batch["pixel_values"], torch.cat(expected), rtol=0, atol=0)
    # The model takes the batch: its image tokens match the pixels, and the loss is finite.
    model = load_pretrained(TINY_VL, dtype=torch.float32)
    loss_sum, num_tokens = batch_loss(CrossEntropyLoss(), model, batch)
    (loss_sum / num_tokens).backward()
    assert torch.isfinite(loss_sum)


def test_the_downscaled_pixels_equal_transformers_processor_with_the_share(tokenizer, data):
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    file, folder = data
    budget = 15_000
    fitted = _build(tokenizer, file, folder, max_pixels_per_sample=budget)
    batch = sft_collate(tokenizer)([fitted[0]], pad_id=tokenizer.pad_id)
    config = json.loads((TINY_VL / "preprocessor_config.json").read_text())
    config.pop("image_processor_type")
    pixels = []
    shared = _shared(image_processing_for(tokenizer), list(SIZES), budget)
    for name, each in zip(SIZES, shared, strict=True):
        settings = {"max_pixels": each.max_pixels, "min_pixels": each.min_pixels}
        theirs = pil.Qwen2VLImageProcessorPil(**{**config, **settings})
        out = theirs(images=[Image.open(folder / name)], return_tensors="pt")
        pixels.append(out["pixel_values"])
    torch.testing.assert_close(batch["pixel_values"], torch.cat(pixels), rtol=0, atol=1e-5)


def test_a_row_that_cannot_fit_is_one_line_or_skipped(tokenizer, data):
    file, folder = data
    # Three images need at least 3 x 28 x 28 = 2352 pixels.
    with pytest.raises(DataError) as caught:
        _build(tokenizer, file, folder, max_pixels_per_sample=2000)
    message = str(caught.value)
    assert "\n" not in message
    assert f"{file}:1: row 0" in message
    assert "2352" in message and "max_pixels_per_sample 2000" in message
    kept = _build(tokenizer, file, folder, max_pixels_per_sample=2000, skip_malformed=True)
    assert len(kept) == 2 and kept.num_skipped == 1  # one image (784) and two (1568) fit
    assert kept[1]["image_grids"] and sum(_area(g) for g in kept[1]["image_grids"]) <= 2000


def test_gemma3_images_over_the_budget_are_refused(data):
    file, folder = data
    tokenizer = load_tokenizer(TINY_GEMMA3_VL, max_seq_len=256)
    side = image_processing_for(tokenizer).image_size
    budget = 2 * side * side
    kept = _build(tokenizer, file, folder, max_pixels_per_sample=budget, skip_malformed=True)
    assert len(kept) == 2 and kept.num_skipped == 1  # the row of three images
    with pytest.raises(DataError, match=r"train.jsonl:1: row 0 .*cannot be downscaled"):
        _build(tokenizer, file, folder, max_pixels_per_sample=budget)


def test_grpo_prompts_get_the_budget(tokenizer, data):
    file, folder = data
    parts = [{"type": "image", "image": name} for name in SIZES]
    parts.append({"type": "text", "text": QUESTION})
    prompts_file = _write(
        folder / "prompts.jsonl", [{"prompt": [{"role": "user", "content": parts}]}]
    )
    prompts = prompt_dataset(
        tokenizer, source="json", data_files=prompts_file, max_pixels_per_sample=15_000
    )
    fitted = _build(tokenizer, file, folder, max_pixels_per_sample=15_000)
    images = prompts.prompt_images(0)
    assert images["image_grid_thw"].tolist() == fitted[0]["image_grids"]
    batch = sft_collate(tokenizer)([fitted[0]], pad_id=tokenizer.pad_id)
    torch.testing.assert_close(images["pixel_values"], batch["pixel_values"], rtol=0, atol=0)


def test_preference_pairs_get_the_budget(tokenizer, data):
    file, folder = data
    parts = [{"type": "image", "image": name} for name in SIZES]
    parts.append({"type": "text", "text": QUESTION})
    pairs_file = _write(
        folder / "pairs.jsonl",
        [{"prompt": [{"role": "user", "content": parts}], "chosen": "A.", "rejected": "B."}],
    )
    pairs = image_preference_dataset(
        tokenizer,
        source="json",
        data_files=pairs_file,
        num_proc=1,
        cache_dir=str(folder / "cache"),
        max_pixels_per_sample=15_000,
    )
    fitted = _build(tokenizer, file, folder, max_pixels_per_sample=15_000)
    assert pairs[0]["image_grids"] == fitted[0]["image_grids"]
    batch = preference_collate(tokenizer)([{**pairs[0], "pair_index": 0}], pad_id=0)
    one = sft_collate(tokenizer)([fitted[0]], pad_id=tokenizer.pad_id)["pixel_values"]
    torch.testing.assert_close(batch["pixel_values"], torch.cat([one, one]), rtol=0, atol=0)
