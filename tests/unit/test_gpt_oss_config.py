"""gpt-oss-20b's published ``config.json`` parses into the model the docs' memory table counts.

The dict is the hub file's (transformers 4.x layout: ``rope_scaling`` and ``rope_theta``, an
``mxfp4`` ``quantization_config``); the model is built on the meta device (nothing allocated).
"""

import pytest
import torch

from tunelab.errors import ConfigError
from tunelab.models import args_from_hf, from_hf_config

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "attention_dropout": 0.0, "eos_token_id": 200002, "pad_token_id": 199999, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "experts_per_token": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}  # fmt: skip


def test_gpt_oss_20b_config_parses_into_its_published_size():
    args = args_from_hf(GPT_OSS_20B)
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_dim) == (32, 4, 2880)
    assert args.sliding_window == 128 and args.layer_type(0) == "sliding_attention"
    assert args.layer_type(1) == "full_attention"
    assert args.rope_theta == 150000.0 and args.rope_scaling["truncate"] is False
    assert args.rope_scaling["factor"] == 32.0 and args.swiglu_limit == 7.0
    assert args.attention_sinks and args.router_bias and args.expert_bias and args.qkv_bias
    with torch.device("meta"):
        model = from_hf_config(GPT_OSS_20B)
    params = dict(model.named_parameters())
    assert params["model.layers.0.mlp.experts.gate_up_proj"].shape == (32, 2880, 5760)
    assert params["model.layers.0.mlp.experts.down_proj"].shape == (32, 2880, 2880)
    assert params["model.layers.0.self_attn.sinks"].shape == (64,)
    total = sum(p.numel() for p in params.values())
    experts = sum(p.numel() for name, p in params.items() if ".experts." in name)
    assert (total, experts) == (20_914_757_184, 19_116_933_120)  # docs/models.md's 20.91B, 19.12B
    hub = model.state_dict_adapter.to_hf(model.state_dict())
    assert "model.layers.0.mlp.router.bias" in hub and "model.layers.0.mlp.gate.bias" not in hub
    assert model.state_dict_adapter.mxfp4_hf_keys("model.layers.0.mlp.experts.down_proj") == (
        "model.layers.0.mlp.experts.down_proj_blocks",
        "model.layers.0.mlp.experts.down_proj_scales",
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method 'bitsandbytes'"),
        ({"attention_dropout": 0.1}, "attention_dropout 0.1"),
    ],
)
def test_unsupported_gpt_oss_settings_are_one_error(change, message):
    with pytest.raises(ConfigError, match=message):
        args_from_hf({**GPT_OSS_20B, **change})
