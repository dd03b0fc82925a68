"""tunelab's Qwen2.5-VL image preprocessing against transformers' Qwen2-VL image processor.

Generated images of several sizes and aspect ratios (upscaled past ``min_pixels``, shrunk
under ``max_pixels``, exact multiples left alone) and modes (RGB, grey, RGBA and a palette
with a transparent colour, which both composite onto white): pixel values and grids equal
transformers' (PIL backend), and so do the token counts.
"""

import pytest
import torch
from PIL import Image

from tunelab.data.images import ImageError, ImageProcessing, open_image, smart_resize

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    # Measured on 4.56 (the floor): no PIL Qwen2-VL image processor module, and the tiny
    # Qwen2_5_VLConfig built from a text_config dict fails to load ('NoneType' not subscriptable).
    pytest.skip(
        f"Qwen2.5-VL interop is checked on transformers 5, not {transformers.__version__}",
        allow_module_level=True,
    )
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 40


def _hf_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def _image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}.get(mode, 1)
    values = torch.randint(
        0, 256, (height, width, channels), generator=generator, dtype=torch.uint8
    )
    array = values.numpy()
    if mode == "P":
        image = Image.fromarray(array[..., 0], mode="L").convert("P")
        image.info["transparency"] = int(array[0, 0, 0])
        return image
    return Image.fromarray(array[..., 0] if channels == 1 else array, mode=mode)


@pytest.mark.parametrize(
    "width, height, mode",
    [
        (56, 56, "RGB"),  # exact multiple, at min_pixels
        (30, 20, "RGB"),  # too small: grows
        (300, 90, "RGB"),  # wide, shrinks under max_pixels
        (77, 250, "L"),  # tall, grey
        (123, 97, "RGBA"),  # odd sides, alpha onto white
        (64, 48, "P"),  # palette with a transparent colour
    ],
)
def test_pixel_values_and_grid_equal_transformers(width, height, mode):
    image = _image(width, height, mode, seed=width * height)
    processing = ImageProcessing(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    pixels, grid = processing(image)
    theirs = _hf_processor()(images=[image], return_tensors="pt")
    assert list(grid) == theirs["image_grid_thw"][0].tolist()
    assert pixels.shape == theirs["pixel_values"].shape
    assert float((pixels - theirs["pixel_values"]).abs().max()) <= 1e-6
    tokens = processing.num_tokens(height, width)
    assert tokens == int(theirs["image_grid_thw"][0].prod()) // 4
    assert tokens * 4 == pixels.shape[0]


def test_two_images_concatenate_in_order():
    images = [_image(100, 60, "RGB", 1), _image(40, 90, "RGB", 2)]
    processing = ImageProcessing(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    ours = [processing(image) for image in images]
    theirs = _hf_processor()(images=images, return_tensors="pt")
    assert torch.equal(
        torch.tensor([grid for _, grid in ours]), theirs["image_grid_thw"].to(torch.long)
    )
    pixels = torch.cat([values for values, _ in ours])
    assert float((pixels - theirs["pixel_values"]).abs().max()) <= 1e-6


def test_reads_preprocessor_config_like_transformers():
    config = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2}
    processing = ImageProcessing.from_preprocessor_config(config)
    assert (processing.min_pixels, processing.max_pixels) == (3136, 12845056)
    new_style = {"size": {"shortest_edge": 1000, "longest_edge": 2000}}
    assert ImageProcessing.from_preprocessor_config(new_style).max_pixels == 2000


def test_smart_resize_hand_checked():
    assert smart_resize(56, 56, 28, 56 * 56, 28 * 28 * 40) == (56, 56)
    assert smart_resize(20, 30, 28, 56 * 56, 10**6) == (56, 84)  # grown by sqrt(3136/600)
    assert smart_resize(1000, 1000, 28, 56 * 56, 28 * 28 * 4) == (56, 56)
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(1, 500, 28, 56 * 56, 10**6)


def test_open_image_refuses_bad_files(tmp_path):
    good = tmp_path / "good.png"
    _image(40, 30, "RGB", 0).save(good)
    assert open_image(good, 10_000).size == (40, 30)
    with pytest.raises(ImageError, match="over the limit"):
        open_image(good, 1_000)  # a decompression bomb, by the header alone
    with pytest.raises(ImageError, match="not found"):
        open_image(tmp_path / "missing.png", 10_000)
    text = tmp_path / "text.png"
    text.write_text("not an image")
    with pytest.raises(ImageError, match="not an image"):
        open_image(text, 10_000)
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(ImageError, match="empty"):
        open_image(empty, 10_000)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:-200])
    with pytest.raises(ImageError, match="truncated"):
        open_image(truncated, 10_000)


@pytest.mark.parametrize(
    "patch_size, temporal_patch_size, mean, std",
    [
        (14, 2, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        (16, 2, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),  # Qwen3-VL's settings
        (14, 1, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    ],
)
def test_every_byte_of_every_channel_is_equal_to_the_bit(
    patch_size, temporal_patch_size, mean, std
):
    """Scaling and normalising are done in place on the patches (``/ 255``, ``- mean``,
    ``/ std`` in float32): every byte value in each channel, left unresized, gives the very
    float32 transformers' float64 rescale and float32 normalise give."""
    side = 2 * patch_size * 2
    ramp = torch.arange(side * side).view(side, side)
    values = torch.stack([(ramp * 7 + 85 * channel) % 256 for channel in range(3)], dim=-1)
    image = Image.fromarray(values.to(torch.uint8).numpy(), mode="RGB")
    settings = {
        "min_pixels": side * side, "max_pixels": side * side, "patch_size": patch_size,
        "temporal_patch_size": temporal_patch_size, "image_mean": mean, "image_std": std,
    }  # fmt: skip
    pixels, grid = ImageProcessing.from_preprocessor_config(settings)(image)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    theirs = Qwen2VLImageProcessorPil(**settings)(images=[image], return_tensors="pt")
    assert all(len(values[..., c].unique()) == 256 for c in range(3))
    assert list(grid) == theirs["image_grid_thw"][0].tolist()
    assert torch.equal(pixels, theirs["pixel_values"])
