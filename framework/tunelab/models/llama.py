"""The Llama family (Llama 2, 3, 3.1, 3.2): builders, HF config parsing, key mapping.

Hyper-parameters are those of the published ``config.json`` files. Builders create the module
on the current default device: ``with torch.device("meta"): llama3_1_70b()`` allocates nothing.
"""

from collections.abc import Mapping
from typing import Any

import torch

from tunelab.models.args import ModelArgs, args_from_hf_config, common_hf_config
from tunelab.models.decoder import TransformerDecoder
from tunelab.models.state_dict_adapter import StateDictAdapter

# Llama 3.1 and 3.2 extend the 8k context of Llama 3 with the "llama3" frequency rule.
_LLAMA3_1_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_2_SCALING = {**_LLAMA3_1_SCALING, "factor": 32.0}
_LLAMA3_TOKENS = {"bos_token_id": 128000, "eos_token_id": 128001}


class LlamaStateDictAdapter(StateDictAdapter):
    """Llama keys are the native names; only the tied ``lm_head`` needs care (Llama 3.2)."""

    model_type = "llama"
    architecture = "LlamaForCausalLM"

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``LlamaConfig`` dict (see ``StateDictAdapter.hf_config``)."""
        config = common_hf_config(self.args)
        # Llama's one switch covers q/k/v and o; a q/k/v-only bias is not expressible.
        config["attention_bias"] = self.args.output_bias
        config["mlp_bias"] = self.args.mlp_bias
        return self._with_identity(config, torch_dtype)


def llama_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a Llama ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments.
    """
    attention_bias = bool(config.get("attention_bias", False))
    return args_from_hf_config(
        config,
        "llama",
        qkv_bias=attention_bias,
        output_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
    )


def _llama(**kwargs: Any) -> TransformerDecoder:
    return TransformerDecoder(ModelArgs(family="llama", **kwargs))


def llama2_7b() -> TransformerDecoder:
    """Llama 2 7B (6.74B parameters, multi-head attention, 4k context)."""
    return _llama(
        vocab_size=32000,
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        intermediate_dim=11008,
        norm_eps=1e-5,
        max_seq_len=4096,
        extra_hf_config={"bos_token_id": 1, "eos_token_id": 2},
    )


def llama3_8b() -> TransformerDecoder:
    """Llama 3 8B (8.03B parameters, GQA with 8 KV heads, 8k context)."""
    return _llama(
        vocab_size=128256,
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_dim=14336,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=8192,
        extra_hf_config=dict(_LLAMA3_TOKENS),
    )


def llama3_1_8b() -> TransformerDecoder:
    """Llama 3.1 8B (Llama 3 8B shapes, llama3 rope scaling, 128k context)."""
    return _llama(
        vocab_size=128256,
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_dim=14336,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_1_SCALING),
        max_seq_len=131072,
        extra_hf_config=dict(_LLAMA3_TOKENS),
    )


def llama3_1_70b() -> TransformerDecoder:
    """Llama 3.1 70B (70.6B parameters, 80 layers, 8 KV heads)."""
    return _llama(
        vocab_size=128256,
        dim=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        intermediate_dim=28672,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_1_SCALING),
        max_seq_len=131072,
        extra_hf_config=dict(_LLAMA3_TOKENS),
    )


def llama3_2_1b() -> TransformerDecoder:
    """Llama 3.2 1B (1.24B parameters, tied embeddings, rope factor 32)."""
    return _llama(
        vocab_size=128256,
        dim=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_dim=8192,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_2_SCALING),
        max_seq_len=131072,
        tie_embeddings=True,
        extra_hf_config=dict(_LLAMA3_TOKENS),
    )


def llama3_2_3b() -> TransformerDecoder:
    """Llama 3.2 3B (3.21B parameters, tied embeddings, rope factor 32)."""
    return _llama(
        vocab_size=128256,
        dim=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        head_dim=128,
        intermediate_dim=8192,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_2_SCALING),
        max_seq_len=131072,
        tie_embeddings=True,
        extra_hf_config=dict(_LLAMA3_TOKENS),
    )
