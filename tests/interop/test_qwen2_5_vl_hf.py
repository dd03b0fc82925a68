"""Qwen2.5-VL in tunelab's own modules against transformers' ``Qwen2_5_VLForConditionalGeneration``.

One tiny random checkpoint, saved by transformers: window attention (windows of 2 x 2 merge
squares, so images of 4 x 6 and more merge squares hold several windows, edge windows
smaller), one full-attention block, GQA, M-RoPE sections 2/3/3. Logits agree within 1e-4 on
the same pixel values and ids for several image sizes and aspect ratios, two images in one
row, a text-only row, and an export that transformers loads back.
"""

import pytest
import torch

from tests.interop.vl_checks import (
    TOLERANCE,
    VLSpec,
    check_lora_export,
    check_merged_export,
    max_logit_gap,
    save_tiny_checkpoint,
)
from tunelab.models import load_pretrained
from tunelab.models.vision_language import VisionLanguageDecoder, multimodal_positions

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    # Measured on 4.56 (the floor): no PIL Qwen2-VL image processor module, and the tiny
    # Qwen2_5_VLConfig built from a text_config dict fails to load ('NoneType' not subscriptable).
    pytest.skip(
        f"Qwen2.5-VL interop is checked on transformers 5, not {transformers.__version__}",
        allow_module_level=True,
    )

IMAGE, VIDEO, START, END = 290, 291, 292, 293
PATCH, MERGE = 14, 2


def tiny_qwen2_5_vl_config() -> "transformers.Qwen2_5_VLConfig":
    """A 2-layer language model and a 3-block vision tower (block 1 attends fully)."""
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
            max_position_embeddings=512,
            bos_token_id=None,
            eos_token_id=None,
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
            window_size=56,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    torch.manual_seed(0)
    return save_tiny_checkpoint(
        transformers.Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config()), path
    )


@pytest.fixture(scope="module")
def models(tiny_vl_dir):
    hf_model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny_vl_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return hf_model, load_pretrained(tiny_vl_dir)


SPEC = VLSpec(
    transformers.Qwen2_5_VLForConditionalGeneration, IMAGE, START, END, patch=PATCH, merge=MERGE
)


def _compare(models, rows_grids: list[list[tuple[int, int, int]]]) -> float:
    return max_logit_gap(SPEC, models, rows_grids)


def test_loads_as_vision_language_model(models):
    _, model = models
    assert isinstance(model, VisionLanguageDecoder)
    assert model.args.family == "qwen2_5_vl"
    assert model.args.mrope_section == [2, 3, 3]
    assert model.args.vision.full_attention_blocks == [1]
    assert model.args.vision.image_token_id == IMAGE


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 4, 4)],  # one window
        [(1, 8, 12)],  # 2 x 3 windows
        [(1, 14, 6)],  # tall, edge windows of one merge row
        [(1, 6, 10)],  # wide, edge windows on both sides
    ],
    ids=["square", "windows", "tall", "wide"],
)
def test_one_image_logits_match_transformers(models, grids):
    assert _compare(models, [grids]) <= TOLERANCE


def test_two_images_in_one_row_and_a_second_row(models):
    """Two images of different shapes in row 0, another image in row 1 (right-padded)."""
    assert _compare(models, [[(1, 6, 4), (1, 4, 10)], [(1, 8, 8)]]) <= TOLERANCE


def test_text_only_row_matches_transformers(models):
    assert _compare(models, [[]]) <= TOLERANCE


def test_the_image_changes_the_logits(models):
    """A test that cannot fail is a defect: other pixels give other logits after the image."""
    _, model = models
    grids = [(1, 4, 4)]
    tokens = torch.tensor([SPEC.row(grids)])
    with torch.no_grad():
        a = model(tokens, **SPEC.images(grids, seed=0))
        b = model(tokens, **SPEC.images(grids, seed=1))
    assert float((a[0, -1] - b[0, -1]).abs().max()) > 1e-3


def test_image_tokens_without_pixels_are_refused(models):
    """A batch collated without its images would train image tokens as text: refused."""
    _, model = models
    with pytest.raises(ValueError, match="no pixel_values"):
        model(torch.tensor([SPEC.row([(1, 4, 4)])]))


def test_positions_follow_the_image_grid():
    """Hand-checked M-RoPE positions: 2 text, start, a 2 x 3 merged grid, end, 1 text."""
    tokens = torch.tensor([[7, 8, START] + [IMAGE] * 6 + [END, 9]])
    positions = multimodal_positions(tokens, torch.tensor([[1, 4, 6]]), IMAGE, MERGE)
    assert positions[0, 0].tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7]
    assert positions[1, 0].tolist() == [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7]
    assert positions[2, 0].tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]


def test_packed_documents_restart_positions():
    tokens = torch.tensor([[7, START] + [IMAGE] * 4 + [END, 8, START] + [IMAGE] * 4 + [END]])
    document_ids = torch.tensor([[0] * 8 + [1] * 6])
    grids = torch.tensor([[1, 4, 4], [1, 4, 4]])
    packed = multimodal_positions(tokens, grids, IMAGE, MERGE, document_ids)
    alone = multimodal_positions(tokens[:, 8:], grids[1:], IMAGE, MERGE)
    assert torch.equal(packed[:, :, 8:], alone)
    assert packed[0, 0, :8].tolist() == [0, 1, 2, 2, 2, 2, 4, 5]


def test_export_loads_in_transformers_with_equal_logits(models, tmp_path):
    """Our hub-layout weights and our own config.json load in transformers, logits equal, and
    the config parses back to the same arguments."""
    check_merged_export(SPEC, models[1], tmp_path)


@pytest.mark.parametrize("vision", [(), ("visual.blocks.", "visual.merger.")])
def test_lora_export_loads_in_peft_and_transformers(tiny_vl_dir, tmp_path, vision):
    """LoRA on every linear layer of the language model (the tower frozen, or with
    ``model.vision_tower: lora`` and ``model.projector: lora`` every linear layer of the
    tower's blocks and of the projector adapted too), exported by ``export_hf`` as the
    recipes do: PEFT loads the adapter onto transformers' model, and transformers the merged
    weights, both with our logits on an image row."""
    pytest.importorskip("peft")
    check_lora_export(SPEC, tiny_vl_dir, tmp_path, vision)
