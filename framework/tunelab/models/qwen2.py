"""The Qwen2 / Qwen2.5 family: builders, HF config parsing, key mapping.

Qwen2 is the Llama block with a bias on the q/k/v projections (none on ``o_proj``) and, on the
small sizes, tied embeddings. Builders create the module on the current default device.
"""

from collections.abc import Mapping
from typing import Any

import torch

from tunelab.errors import ConfigError
from tunelab.models.args import ModelArgs, args_from_hf_config, common_hf_config
from tunelab.models.decoder import TransformerDecoder
from tunelab.models.state_dict_adapter import StateDictAdapter

_QWEN_TOKENS = {"bos_token_id": 151643, "eos_token_id": 151643}


class Qwen2StateDictAdapter(StateDictAdapter):
    """Qwen2 keys are the native names (``q_proj.bias`` included)."""

    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``Qwen2Config`` dict (see ``StateDictAdapter.hf_config``)."""
        config = common_hf_config(self.args)
        config["use_sliding_window"] = False
        return self._with_identity(config, torch_dtype)


def qwen2_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a Qwen2 ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments.

    Raises:
        ConfigError: the checkpoint uses sliding-window attention (not supported).
    """
    if config.get("use_sliding_window", False):
        raise ConfigError("Qwen2 use_sliding_window=true is not supported")
    return args_from_hf_config(config, "qwen2", qkv_bias=True)


def _qwen2(**kwargs: Any) -> TransformerDecoder:
    return TransformerDecoder(
        ModelArgs(
            family="qwen2",
            qkv_bias=True,
            norm_eps=1e-6,
            rope_theta=1000000.0,
            max_seq_len=32768,
            extra_hf_config=dict(_QWEN_TOKENS),
            **kwargs,
        )
    )


def qwen2_5_0_5b() -> TransformerDecoder:
    """Qwen2.5 0.5B (494M parameters, tied embeddings)."""
    return _qwen2(
        vocab_size=151936,
        dim=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_dim=4864,
        tie_embeddings=True,
    )


def qwen2_5_1_5b() -> TransformerDecoder:
    """Qwen2.5 1.5B (1.54B parameters, tied embeddings)."""
    return _qwen2(
        vocab_size=151936,
        dim=1536,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        intermediate_dim=8960,
        tie_embeddings=True,
    )


def qwen2_5_7b() -> TransformerDecoder:
    """Qwen2.5 7B (7.62B parameters, untied embeddings)."""
    return _qwen2(
        vocab_size=152064,
        dim=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        intermediate_dim=18944,
        tie_embeddings=False,
    )
