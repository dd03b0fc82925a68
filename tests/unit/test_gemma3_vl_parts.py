"""Gemma 3 multimodal parts with hand-checked values: the image-block mask on every kernel,
the image text in rendered chat rows, the refusals (one line each), and which parts train."""

import pytest
import torch

from tunelab._paths import assets_dir
from tunelab.config.lora import LoRAArgs
from tunelab.config.sections import LoRASFTModelSetupArgs
from tunelab.data.image_rows import ImagesInText
from tunelab.data.images_gemma3 import Gemma3ImageProcessing
from tunelab.errors import ConfigError
from tunelab.models.gemma3_vl import gemma3_vl_args_from_hf
from tunelab.modules.attention import Attention
from tunelab.modules.masks import AttentionMask, image_block_ends
from tunelab.training import build_model

# Eager flex_attention (CPU) warns that it is the unfused debug path; that is what runs here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
TINY_GEMMA3_VL = assets_dir() / "tiny_gemma3_vl"
CPU = torch.device("cpu")


def test_image_block_ends_by_hand():
    is_image = torch.tensor([[0, 1, 1, 0, 1, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0, 1, 1]]).bool()
    assert image_block_ends(is_image).tolist() == [
        [0, 2, 2, 3, 4, 5, 8, 8, 8],
        [1, 1, 2, 3, 4, 5, 6, 8, 8],
    ]


def _reference(is_image: torch.Tensor, window: int | None) -> torch.Tensor:
    """transformers' rule element by element: (causal OR same image block) AND window."""
    batch, seq_len = is_image.shape
    blocks = torch.cumsum(is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1], 1)
    blocks = torch.where(is_image, blocks, -1)
    allowed = torch.zeros(batch, seq_len, seq_len, dtype=torch.bool)
    for b in range(batch):
        for q in range(seq_len):
            for k in range(seq_len):
                same = bool(blocks[b, q] >= 0 and blocks[b, q] == blocks[b, k])
                inside = window is None or k > q - window
                allowed[b, q, k] = (k <= q or same) and inside
    return allowed


@pytest.mark.parametrize("window", [None, 3, 6])
def test_described_mask_is_causal_or_same_block_within_the_window(window):
    """The dense form equals the element rule; sdpa and flex attention under it equal the
    dense-mask attention (rows of 300 tokens: three flex blocks, images across their edges)."""
    generator = torch.Generator().manual_seed(0)
    is_image = torch.zeros(2, 300, dtype=torch.bool)
    for row, starts in enumerate([(3, 120, 250), (0, 126, 290)]):
        for start in starts:
            is_image[row, start : start + 7] = True
    small = is_image[:, :40]
    mask = AttentionMask(2, 40, CPU, "sdpa", last_keys=image_block_ends(small))
    mask = mask.with_window(window)
    assert torch.equal(mask.dense()[:, 0], _reference(small, window))
    attention = Attention(32, 4, 2, 8).eval()
    x = torch.randn(2, 300, 32, generator=generator)
    cos, sin = torch.ones(2, 300, 8), torch.zeros(2, 300, 8)
    outputs = {}
    for backend in ("dense", "sdpa", "flex"):
        described = AttentionMask(2, 300, CPU, backend, last_keys=image_block_ends(is_image))
        with torch.no_grad():
            outputs[backend] = attention(x, cos, sin, described.with_window(window).prepare())
    for backend in ("sdpa", "flex"):
        assert float((outputs[backend] - outputs["dense"]).abs().max()) <= 1e-5, backend


def test_images_in_text_replace_placeholders_and_move_spans():
    class Template:
        has_generation_blocks = True

        def render_with_spans(self, messages, **options):
            text = "u:<boi>A<boi>B|m:ok|"
            return text, [(text.index("ok"), text.index("ok") + 2)]

    wrapped = ImagesInText(Template(), "<boi>", ["[one]", "[two!]"])
    text, spans = wrapped.render_with_spans([])
    assert text == "u:[one]A[two!]B|m:ok|"
    assert [text[low:high] for low, high in spans] == ["ok"]
    assert wrapped.has_generation_blocks
    with pytest.raises(Exception, match="wrote 2 <boi> for 1 images"):
        ImagesInText(Template(), "<boi>", ["x"]).render_with_spans([])


def test_pan_and_scan_crops_by_hand():
    processing = Gemma3ImageProcessing(do_pan_and_scan=True, pan_and_scan_min_crop_size=100)
    assert processing.crops(300, 310) == []  # ratio under 1.2
    # Ratio 2.5: round(2.5) = 3 crops of ceil(500 / 3) = 167 columns, the last one 166.
    assert processing.crops(200, 500) == [(0, 0, 167, 200), (167, 0, 334, 200), (334, 0, 500, 200)]
    assert processing.num_tokens(200, 500) == 4 * 256
    assert processing.crops(500, 200) == [(0, 0, 200, 167), (0, 167, 200, 334), (0, 334, 200, 500)]
    assert len(processing.crops(100, 1000)) == 4  # ratio 10, capped at 4 crops
    assert len(processing.crops(150, 250)) == 2  # 2 crops of 125 x 150
    # Ratio 1.2: one crop wide, raised to the minimum of 2, 90 columns each: under 100, none.
    assert processing.crops(150, 180) == []
    assert Gemma3ImageProcessing().crops(200, 500) == []  # off by default


def test_bad_configs_are_one_line_each():
    base = {"text_config": {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2}}
    vision = {"hidden_size": 32, "image_size": 64, "patch_size": 8, "num_hidden_layers": 1}
    vision |= {"num_attention_heads": 2, "intermediate_size": 64}
    for config, message in [
        (base | {"vision_config": vision}, "vision_use_head=true is not supported"),
        (
            base | {"vision_config": vision | {"vision_use_head": False, "model_type": "clip"}},
            "model_type 'clip'",
        ),  # fmt: skip
        (
            base | {"vision_config": vision | {"vision_use_head": False}, "mm_tokens_per_image": 9},
            "mm_tokens_per_image 9",
        ),  # fmt: skip
        (
            base | {"vision_config": vision | {"vision_use_head": False, "image_size": 60}},
            "multiple of patch_size",
        ),  # fmt: skip
    ]:
        with pytest.raises(ConfigError, match=message) as error:
            gemma3_vl_args_from_hf(config)
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="size .* is not square"):
        Gemma3ImageProcessing.from_preprocessor_config({"size": {"height": 64, "width": 32}})


def test_projector_lora_is_refused_and_the_parts_train_as_asked():
    lora = LoRAArgs(rank=2, alpha=4.0, targets=["q_proj", "v_proj"])
    section = LoRASFTModelSetupArgs(path=str(TINY_GEMMA3_VL), projector="lora")
    with pytest.raises(ConfigError, match="model.projector: lora adapts linear layers") as error:
        build_model(section, device=CPU, lora=lora)
    assert "\n" not in str(error.value)
    section = LoRASFTModelSetupArgs(path=str(TINY_GEMMA3_VL), vision_tower="lora", projector="full")
    model = build_model(section, device=CPU, lora=lora)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    tower = {name for name in trainable if name.startswith("vision_tower.")}
    # The tower's q_proj and v_proj adapted (not its fc1, fc2, k_proj, out_proj: under lora,
    # every linear of its blocks is adapted), the projector trained whole.
    assert tower and all(".lora_" in name for name in tower)
    assert {name for name in tower if "mlp.fc1" in name}
    assert {"multi_modal_projector.mm_input_projection_weight"} <= trainable
    assert model.peft_modules_to_save() == ["multi_modal_projector"]
    language = {name for name in trainable if name.startswith("model.")}
    assert language and all(".lora_" in name for name in language)
