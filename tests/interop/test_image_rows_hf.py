"""Chat rows with images: ids and trained masks equal transformers' processor.

A tiny byte-level BPE with Qwen2.5-VL's special tokens and a Qwen2.5-VL style chat template
(its assistant text inside ``{% generation %}`` blocks, so transformers'
``return_assistant_tokens_mask`` gives the trained tokens). Rows name their images as content
parts (``image`` and ``path`` keys) or through an ``images`` column with ``<image>``
placeholders; ``Qwen2_5_VLProcessor.apply_chat_template`` gets the same conversations with the
images in content parts. Bad rows are refused with one line each.
"""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.interop.vl_checks import write_chat_tokenizer
from tunelab.data.chat import chat_template_of
from tunelab.data.image_rows import ImageChatRows, read_image_messages
from tunelab.data.images import ImageProcessing, open_image
from tunelab.data.rows import IGNORE_INDEX, BadRow
from tunelab.data.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    # Measured on 4.56 (the floor): no PIL Qwen2-VL image processor module, and the tiny
    # Qwen2_5_VLConfig built from a text_config dict fails to load ('NoneType' not subscriptable).
    pytest.skip(
        f"Qwen2.5-VL interop is checked on transformers 5, not {transformers.__version__}",
        allow_module_level=True,
    )

# Qwen2.5-VL's template, with {% generation %} around what the assistant generates.
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>{% endgeneration %}\n"
    "{% elif message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_vl_folder(tmp_path_factory.mktemp("vl_tokenizer"))


def make_vl_folder(path: Path) -> Path:
    """The tokenizer files, a preprocessor config and four images, written into ``path``."""
    text = "What colour is the square? It is red. Which shape is it? A circle, blue."
    write_chat_tokenizer(path, text, TEMPLATE)
    preprocessor = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": 14}
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    for name, size, colour in [
        ("red.png", (40, 30), (255, 0, 0)),
        ("wide.png", (200, 60), (0, 0, 255)),
        ("tall.png", (50, 130), (0, 255, 0)),
        ("grey.png", (90, 90), (128, 128, 128)),
    ]:
        Image.new("RGB", size, colour).save(path / name)
    return path


def _hf_processor(folder):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class Processor(transformers.Qwen2_5_VLProcessor):
        """The processor without its video processor, whose class needs torchvision (absent)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name != "video_processor":
                return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    return Processor(
        image_processor=Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
        tokenizer=tokenizer,
        chat_template=TEMPLATE,
    )


def _rows_function(folder, **overrides):
    tokenizer = load_tokenizer(folder)
    settings = dict(
        tokenizer=tokenizer,
        template=chat_template_of(tokenizer),
        column="messages",
        processing=ImageProcessing(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
        image_dir=str(folder),
        max_image_pixels=100_000,
    )
    return ImageChatRows(**{**settings, **overrides})


def _parts(folder, *items):
    """Content parts: strings are text, ``Path``-like names are images."""
    return [
        {"type": "image", "image": str(folder / item)}
        if item.endswith(".png")
        else {"type": "text", "text": item}
        for item in items
    ]


def _theirs(folder, messages):
    out = _hf_processor(folder).apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        return_tensors="pt",
    )
    ids = out["input_ids"][0].tolist()
    labels = [t if m else IGNORE_INDEX for t, m in zip(ids, out["assistant_masks"][0].tolist())]
    return ids, labels, out["image_grid_thw"].tolist()


CONVERSATIONS = {
    "one image": lambda f: [
        {"role": "user", "content": _parts(f, "red.png", "What colour is the square?")},
        {"role": "assistant", "content": "It is red."},
    ],
    "two images, two turns": lambda f: [
        {"role": "user", "content": _parts(f, "wide.png", "Which shape?", "tall.png")},
        {"role": "assistant", "content": "A circle."},
        {"role": "user", "content": _parts(f, "Colour?", "grey.png")},
        {"role": "assistant", "content": "It is blue."},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_ids_masks_and_grids_equal_transformers(folder, name):
    messages = CONVERSATIONS[name](folder)
    (sample,) = _rows_function(folder)({"messages": messages})
    ids, labels, grids = _theirs(folder, messages)
    assert sample["tokens"] == ids
    assert sample["labels"] == labels
    assert sample["image_grids"] == grids
    assert any(label != IGNORE_INDEX for label in sample["labels"])


def test_a_turned_photo_is_read_upright_as_transformers_does(folder):
    """A JPEG stored landscape with EXIF orientation 6 (a portrait phone photo) is upright."""
    stored = torch.arange(60 * 200 * 3).remainder(251).to(torch.uint8).reshape(60, 200, 3)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: turn 90 degrees clockwise to view
    path = folder / "turned.jpg"
    Image.fromarray(stored.numpy()).save(path, exif=exif, quality=95)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": str(path)}, {"type": "text", "text": "Colour?"}],
        },
        {"role": "assistant", "content": "It is red."},
    ]
    rows = _rows_function(folder)
    (sample,) = rows({"messages": messages})
    theirs = _hf_processor(folder).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert sample["tokens"] == theirs["input_ids"][0].tolist()
    assert sample["image_grids"] == theirs["image_grid_thw"].tolist()
    pixels, grid = rows.processing(open_image(path, 100_000))
    torch.testing.assert_close(pixels, theirs["pixel_values"], rtol=0, atol=1e-6)
    assert open_image(path, 100_000).size == (60, 200)
    # The stored (landscape) image has another grid: the check sees an unturned read.
    assert rows.processing(Image.open(path))[1] != grid


def test_path_parts_and_placeholder_column_give_the_same_sample(folder):
    """The three ways of naming images make one sample (relative paths from image_dir)."""
    rows = _rows_function(folder)
    parts = CONVERSATIONS["two images, two turns"](folder)
    by_path = json.loads(json.dumps(parts).replace('"image": ', '"path": '))
    placeholder = {
        "messages": [
            {"role": "user", "content": "<image>Which shape?<image>"},
            {"role": "assistant", "content": "A circle."},
            {"role": "user", "content": "Colour?<image>"},
            {"role": "assistant", "content": "It is blue."},
        ],
        "images": ["wide.png", "tall.png", "grey.png"],
    }
    expected = rows({"messages": parts})
    assert rows({"messages": by_path}) == expected
    assert rows(placeholder) == expected


def test_bad_rows_are_one_line_each(folder):
    rows = _rows_function(folder)
    (folder / "empty.png").write_bytes(b"")
    (folder / "cut.png").write_bytes((folder / "wide.png").read_bytes()[:-40])
    Image.new("RGB", (400, 400)).save(folder / "big.png")
    user = {"role": "user", "content": "<image>Colour?"}
    answer = {"role": "assistant", "content": "Red."}
    cases = {
        "missing.png": "not found",
        "empty.png": "empty",
        "cut.png": "truncated",
        "big.png": "over the limit",
    }
    for file, problem in cases.items():
        with pytest.raises(BadRow, match=problem) as caught:
            rows({"messages": [user, answer], "images": [file]})
        assert "\n" not in str(caught.value.problem)
    with pytest.raises(BadRow, match="1 <image> placeholders in the messages but 2 images"):
        rows({"messages": [user, answer], "images": ["red.png", "red.png"]})
    with pytest.raises(BadRow, match="text-only"):
        _rows_function(folder, processing=None)({"messages": [user, answer], "images": ["red.png"]})
    with pytest.raises(BadRow, match="would cut an image"):
        _rows_function(folder, max_seq_len=10)({"messages": [user, answer], "images": ["red.png"]})


def test_placeholders_split_into_parts():
    messages, files = read_image_messages(
        [{"role": "user", "content": "a<image>b<image>"}], "messages", ["x.png", "y.png"], "images"
    )
    assert files == ["x.png", "y.png"]
    assert messages[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image"},
        {"type": "text", "text": "b"},
        {"type": "image"},
    ]


def test_image_tokens_match_the_pixels(folder):
    """Each sample's image tokens equal its images' patches / 4, so the model's scatter fits."""
    rows = _rows_function(folder)
    (sample,) = rows({"messages": CONVERSATIONS["two images, two turns"](folder)})
    processing = rows.processing
    patches = sum(processing(Image.open(path))[0].shape[0] for path in sample["images"])
    image_token = load_tokenizer(folder).token_to_id("<|image_pad|>")
    assert sample["tokens"].count(image_token) * 4 == patches
    assert torch.tensor(sample["image_grids"]).prod(-1).sum() == patches


def _tiny_model(tokenizer):
    from tunelab.models import ModelArgs
    from tunelab.models.vision_language import VisionLanguageDecoder
    from tunelab.modules.vision import VisionArgs

    vision = VisionArgs(
        depth=2,
        dim=32,
        intermediate_dim=48,
        num_heads=2,
        out_dim=64,
        window_size=56,
        full_attention_blocks=[1],
        image_token_id=tokenizer.token_to_id("<|image_pad|>"),
    )
    args = ModelArgs(
        vocab_size=tokenizer.vocab_size,
        dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_dim=96,
        qkv_bias=True,
        family="qwen2_5_vl",
        mrope_section=[2, 3, 3],
        vision=vision,
    )
    torch.manual_seed(0)
    return VisionLanguageDecoder(args)


def test_lora_training_steps_on_image_rows(folder):
    """Rows -> collate (images read here) -> LoRA steps: the language model's adapters learn,
    the vision tower and projector stay frozen unless a target names them."""
    from tunelab.config.lora import LoRAArgs
    from tunelab.data.image_rows import padded_collate_images
    from tunelab.losses import CrossEntropyLoss
    from tunelab.peft import apply_lora
    from tunelab.training.loop import batch_loss

    rows = _rows_function(folder)
    samples = [
        *rows({"messages": CONVERSATIONS["one image"](folder)}),
        *rows({"messages": CONVERSATIONS["two images, two turns"](folder)}),
    ]
    batch = padded_collate_images(samples, pad_id=0, processing=rows.processing)
    assert batch["image_grid_thw"].tolist() == [g for s in samples for g in s["image_grids"]]
    image_token = rows.tokenizer.token_to_id("<|image_pad|>")
    assert not bool((batch["labels"] == image_token).any())  # image tokens are never trained

    model = _tiny_model(rows.tokenizer)
    adapted = apply_lora(model, LoRAArgs(rank=4, alpha=8, targets=["all-linear"]))
    assert adapted and not any(name.startswith("visual.") for name in adapted)
    assert not any(p.requires_grad for p in model.visual.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    loss_fn = CrossEntropyLoss()
    losses = []
    for _ in range(4):
        loss_sum, num_tokens = batch_loss(loss_fn, model, batch)
        (loss_sum / num_tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss_sum.detach() / num_tokens))
    assert losses[-1] < losses[0] - 0.1, losses

    projector = _tiny_model(rows.tokenizer)
    named = apply_lora(
        projector, LoRAArgs(rank=4, alpha=8, targets=["q_proj", "visual.merger.mlp.0"])
    )
    assert "visual.merger.mlp.0" in named
    assert not any(name.startswith("visual.blocks") for name in named)


def test_image_chat_dataset_checks_rows_before_training(folder, tmp_path):
    """Bad images are one line with the file and line; skip_malformed skips them; the cached
    items collate into the model's inputs; a text-only model's tokenizer refuses images."""
    import shutil

    from tunelab.data.image_dataset import image_chat_dataset
    from tunelab.data.image_rows import padded_collate_images
    from tunelab.errors import DataError

    data = tmp_path / "data"
    data.mkdir()
    for name in ("red.png", "wide.png"):
        shutil.copy(folder / name, data / name)
    answer = {"role": "assistant", "content": "It is red."}
    rows = [
        {"messages": [{"role": "user", "content": _parts(data, "red.png", "Colour?")}, answer]},
        {
            "messages": [{"role": "user", "content": "<image>Colour?"}, answer],
            "images": ["nope.png"],
        },
        {
            "messages": [{"role": "user", "content": "<image>Shape?"}, answer],
            "images": ["wide.png"],
        },
        {"messages": [{"role": "user", "content": "Colour?"}, answer], "images": ["red.png"]},
    ]
    file = data / "train.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = load_tokenizer(folder, max_seq_len=256)
    build = dict(source="json", data_files=str(file), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError) as caught:
        image_chat_dataset(tokenizer, **build)
    message = str(caught.value)
    assert message.startswith(f"{file}:2: row 1") and "nope.png: image file not found" in message
    assert "\n" not in message
    dataset = image_chat_dataset(tokenizer, skip_malformed=True, **build)
    assert (len(dataset), dataset.num_skipped) == (2, 2)
    items = [dataset[0], dataset[1]]
    assert [Path(p).name for item in items for p in item["images"]] == ["red.png", "wide.png"]
    batch = padded_collate_images(items, 0, ImageProcessing(MIN_PIXELS, MAX_PIXELS))
    image_token = tokenizer.token_to_id("<|image_pad|>")
    assert int((batch["tokens"] == image_token).sum()) * 4 == batch["pixel_values"].shape[0]

    text_only = tmp_path / "text_only"
    text_only.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, text_only / name)
    with pytest.raises(DataError, match="text-only"):
        image_chat_dataset(load_tokenizer(text_only, max_seq_len=256), **build)
