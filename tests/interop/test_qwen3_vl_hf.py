"""Qwen3-VL in tunelab's own modules against transformers' ``Qwen3VLForConditionalGeneration``.

One tiny random checkpoint, saved by transformers: a 3-block vision tower with a 4 x 4
learned position table (resampled up and down to each image's grid), deepstack features
from blocks 0 and 2 added after language layers 0 and 1, interleaved M-RoPE sections 2/3/3,
GQA, per-head q/k norms, tied embeddings (as the 2B and 4B checkpoints). Logits agree within
1e-5 on the same pixel values and ids for several image sizes and aspect ratios, two images
in a row, a padded and a text-only row; exports load in transformers (merged) and PEFT
(adapter); pixel values, grids, token counts and chat-row ids equal the Qwen3-VL processor's.
"""

import pytest
import torch
from PIL import Image

from tests.interop.vl_checks import (
    TOLERANCE,
    VLSpec,
    check_lora_export,
    check_merged_export,
    max_logit_gap,
    save_tiny_checkpoint,
)
from tunelab.data.images import ImageProcessing
from tunelab.data.rows import IGNORE_INDEX
from tunelab.models import load_pretrained
from tunelab.models.vision_language import VisionLanguageDecoder

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    # Qwen3-VL came in transformers 4.57; the floor (4.56) has no Qwen3VLConfig.
    pytest.skip(
        f"Qwen3-VL interop is checked on transformers 5, not {transformers.__version__}",
        allow_module_level=True,
    )

IMAGE, VIDEO, START, END = 290, 291, 292, 293
SPEC = VLSpec(transformers.Qwen3VLForConditionalGeneration, IMAGE, START, END, patch=16)
# Qwen/Qwen3-VL-2B-Instruct's preprocessor_config.json, its pixel bounds made small.
PREPROCESSOR = {
    "size": {"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 24},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


def tiny_qwen3_vl_config() -> "transformers.Qwen3VLConfig":
    """A 3-layer language model and a 3-block vision tower (deepstack from blocks 0 and 2)."""
    return transformers.Qwen3VLConfig(
        text_config=dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
                "rope_theta": 1e4,
            },
            max_position_embeddings=512,
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 2],
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl")
    torch.manual_seed(0)
    return save_tiny_checkpoint(
        transformers.Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config()), path
    )


@pytest.fixture(scope="module")
def models(tiny_vl_dir):
    return SPEC.load_hf(tiny_vl_dir), load_pretrained(tiny_vl_dir)


def test_loads_as_vision_language_model(models):
    _, model = models
    assert isinstance(model, VisionLanguageDecoder)
    args = model.args
    assert (args.family, args.vision.layout) == ("qwen3_vl", "qwen3_vl")
    assert args.mrope_section == [2, 3, 3] and args.mrope_interleaved and args.qk_norm
    assert args.vision.deepstack_blocks == [0, 2]
    assert args.tie_embeddings and model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 4, 4)],  # the position table's own size
        [(1, 2, 2)],  # smaller: the table is sampled down
        [(1, 8, 12)],  # larger, wide
        [(1, 14, 6)],  # tall
    ],
    ids=["table-size", "small", "wide", "tall"],
)
def test_one_image_logits_match_transformers(models, grids):
    assert max_logit_gap(SPEC, models, [grids]) <= TOLERANCE


def test_two_images_a_padded_row_and_a_text_row(models):
    """Two images of different shapes in row 0, another in row 1, row 2 text only."""
    assert max_logit_gap(SPEC, models, [[(1, 6, 4), (1, 4, 10)], [(1, 8, 8)], []]) <= TOLERANCE


def test_deepstack_and_interleaved_rotary_matter(models):
    """A test that cannot fail is a defect: without the deepstack features, or with
    Qwen2.5-VL's consecutive M-RoPE sections, the logits leave transformers'."""
    _, model = models
    args = model.args
    grids = [[(1, 6, 8)]]
    args.mrope_interleaved = False
    try:
        assert max_logit_gap(SPEC, models, grids) > 1e-4
    finally:
        args.mrope_interleaved = True
    blocks, args.vision.deepstack_blocks = args.vision.deepstack_blocks, []
    try:
        assert max_logit_gap(SPEC, models, grids) > 1e-4
    finally:
        args.vision.deepstack_blocks = blocks
    assert max_logit_gap(SPEC, models, grids) <= TOLERANCE


def test_keys_are_the_hub_layout(tiny_vl_dir, models):
    """Our export names every tensor as transformers' own file does (tied lm_head left out)."""
    from safetensors import safe_open

    _, model = models
    with safe_open(tiny_vl_dir / "model.safetensors", "pt") as file:
        theirs = set(file.keys())
    ours = set(model.state_dict_adapter.to_hf(model.state_dict()))
    assert ours == theirs - {"lm_head.weight"}


def test_export_loads_in_transformers_with_equal_logits(models, tmp_path):
    check_merged_export(SPEC, models[1], tmp_path)


TOWER = ("visual.patch_embed.", "visual.pos_embed.", "visual.blocks.")
PROJECTOR = ("visual.merger.", "visual.deepstack_merger_list.")


@pytest.mark.parametrize(
    ("vision", "full"),
    [((), ()), (("visual.blocks.", *PROJECTOR), ()), ((), TOWER + PROJECTOR)],
    ids=["language", "tower-and-projector-lora", "tower-and-projector-full"],
)
def test_lora_export_loads_in_peft_and_transformers(tiny_vl_dir, tmp_path, vision, full):
    """The language model's linears adapted; with ``model.vision_tower: lora`` and
    ``model.projector: lora`` the tower's blocks and every merger's (deepstack's too); with
    both on ``full``, the whole tower and mergers trained, carried as ``modules_to_save``."""
    pytest.importorskip("peft")
    check_lora_export(SPEC, tiny_vl_dir, tmp_path, vision, full)


def _image(width: int, height: int, seed: int) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(values.numpy(), mode="RGB")


def test_pixel_values_grids_and_tokens_equal_the_qwen3_vl_processor():
    """Qwen3-VL's processor is Qwen2-VL's with 16-pixel patches and 0.5 mean and std: read
    from its preprocessor_config.json, ours gives the same pixels, grids and token counts."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    settings = {k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"}
    theirs_processor = Qwen2VLImageProcessorPil(**settings)
    processing = ImageProcessing.from_preprocessor_config(PREPROCESSOR)
    for width, height in [(64, 64), (30, 20), (300, 90), (77, 250)]:
        image = _image(width, height, seed=width * height)
        pixels, grid = processing(image)
        theirs = theirs_processor(images=[image], return_tensors="pt")
        assert list(grid) == theirs["image_grid_thw"][0].tolist()
        assert float((pixels - theirs["pixel_values"]).abs().max()) <= 1e-6
        assert processing.num_tokens(height, width) * 4 == pixels.shape[0]


def test_chat_rows_equal_the_qwen3_vl_processor(tmp_path):
    """Ids, trained masks and grids of chat rows with images equal
    ``Qwen3VLProcessor.apply_chat_template`` with Qwen3-VL's image settings."""
    # The tiny tokenizer, template and images of the Qwen2.5-VL chat-row test.
    from tests.interop.test_image_rows_hf import (
        CONVERSATIONS,
        TEMPLATE,
        _rows_function,
        make_vl_folder,
    )

    folder = make_vl_folder(tmp_path)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    class Processor(transformers.Qwen3VLProcessor):
        """The processor without its video processor, whose class needs torchvision (absent)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name != "video_processor":
                return super().check_argument_for_proper_class(argument_name, argument)

    settings = {k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"}
    processor = Processor(
        image_processor=Qwen2VLImageProcessorPil(**settings),
        tokenizer=transformers.PreTrainedTokenizerFast.from_pretrained(folder),
        chat_template=TEMPLATE,
    )
    rows = _rows_function(folder, processing=ImageProcessing.from_preprocessor_config(PREPROCESSOR))
    for name, conversation in sorted(CONVERSATIONS.items()):
        messages = conversation(folder)
        (sample,) = rows({"messages": messages})
        theirs = processor.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            return_tensors="pt",
        )
        ids, mask = theirs["input_ids"][0].tolist(), theirs["assistant_masks"][0].tolist()
        assert sample["tokens"] == ids, name
        assert sample["labels"] == [t if m else IGNORE_INDEX for t, m in zip(ids, mask)], name
        assert sample["image_grids"] == theirs["image_grid_thw"].tolist(), name
