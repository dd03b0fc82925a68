"""The memory note of ``gemma3/4B_vl_lora`` matches the model's real size.

The config's header states the bf16 weights, the tower's share and the LoRA parameters; here
google/gemma-3-4b-it is built on the meta device from its published ``config.json`` (the keys
it sets; the rest are transformers' defaults, as the family reads them) and counted.
"""

from pathlib import Path

import torch

from tunelab.models import from_hf_config
from tunelab.models.vision_language_gemma3 import Gemma3VisionLanguageDecoder

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gemma3" / "4B_vl_lora.yaml"
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


def test_the_4b_memory_note_matches_the_model():
    with torch.device("meta"):
        model = from_hf_config(GEMMA3_4B)
    assert isinstance(model, Gemma3VisionLanguageDecoder)
    assert model.args.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
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
    header = CONFIG.read_text()
    assert f"weights {2 * total / 1e9:.2f} GB ({total / 1e9:.2f}B parameters" in header
    assert f"language model\n# {(total - vision) / 1e9:.2f}B" in header
    assert f"projector {vision / 1e9:.2f}B" in header
    assert f"projections {adapted / 1e6:.1f}M parameters" in header
