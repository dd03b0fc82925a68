"""The memory notes of the big vision-language configs match the models' real sizes.

Each config's header (``gemma3/4B_vl_lora``, ``qwen2_5_vl/7B_lora``, ``qwen3_vl/8B_lora``)
states the bf16 weights, the language model's and the vision side's parameters and the LoRA
parameters; here google/gemma-3-4b-it, Qwen/Qwen2.5-VL-7B-Instruct and
Qwen/Qwen3-VL-8B-Instruct are built on the meta device from their published ``config.json``
(the keys that set the shapes; the rest are transformers' defaults, as the families read them)
and counted.
"""

from pathlib import Path
from typing import Any

import pytest
import torch

from tunelab.models import from_hf_config
from tunelab.models.vision_language import VisionLanguageDecoder
from tunelab.models.vision_language_gemma3 import Gemma3VisionLanguageDecoder

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# google/gemma-3-4b-it's config.json.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_attention_heads": 8,
        "num_hidden_layers": 34,
        "num_key_value_heads": 4,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
TOKEN_IDS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
# Qwen/Qwen2.5-VL-7B-Instruct's config.json (language keys at the top level, as the hub file).
QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 128000,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
    **TOKEN_IDS,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
    },
}
# Qwen/Qwen3-VL-8B-Instruct's config.json.
QWEN3_VL_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "tie_word_embeddings": False,
    **TOKEN_IDS,
    "text_config": {
        "model_type": "qwen3_vl_text",
        "attention_bias": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "max_position_embeddings": 262144,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
            "rope_type": "default",
        },
        "rope_theta": 5000000,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
    },
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "intermediate_size": 4304,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}


def built(hf_config: dict[str, Any]) -> torch.nn.Module:
    """The model of ``hf_config`` on the meta device."""
    with torch.device("meta"):
        return from_hf_config(hf_config)


@pytest.mark.parametrize(
    ("config_name", "hf_config", "model_class", "embedding"),
    [
        ("gemma3/4B_vl_lora", GEMMA3_4B, Gemma3VisionLanguageDecoder, "262208 x 2560"),
        ("qwen2_5_vl/7B_lora", QWEN2_5_VL_7B, VisionLanguageDecoder, "152064 x 3584"),
        ("qwen3_vl/8B_lora", QWEN3_VL_8B, VisionLanguageDecoder, "151936 x 4096"),
    ],
)
def test_the_memory_note_matches_the_model(
    config_name: str, hf_config: dict[str, Any], model_class: type, embedding: str
):
    model = built(hf_config)
    assert type(model) is model_class
    total = sum(param.numel() for param in model.parameters())
    vision = sum(
        param.numel()
        for name, param in model.named_parameters()
        if name.startswith(model.vision_prefix)
    )
    adapted = sum(
        16 * (module.in_features + module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers.")
    )
    lines = (CONFIGS / f"{config_name}.yaml").read_text().splitlines()
    header = " ".join(line.removeprefix("#").strip() for line in lines if line.startswith("#"))
    assert f"weights {2 * total / 1e9:.2f} GB ({total / 1e9:.2f}B parameters" in header
    assert f"language model {(total - vision) / 1e9:.2f}B with the {embedding} embedding" in header
    assert (
        f" {vision / 1e9:.2f}B), LoRA r16 on the language model's projections "
        f"{adapted / 1e6:.1f}M parameters"
    ) in header


def test_the_published_shapes_are_the_families():
    gemma = built(GEMMA3_4B)
    assert gemma.args.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    for hf_config in (QWEN2_5_VL_7B, QWEN3_VL_8B):
        assert not built(hf_config).args.tie_embeddings
    assert built(QWEN3_VL_8B).args.vision.deepstack_blocks == [8, 16, 24]
