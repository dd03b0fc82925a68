"""The Qwen3 family (dense): HF config parsing and key mapping.

Qwen3 is the Llama block with an RMSNorm over each query and key head (``q_norm``, ``k_norm``)
before rotary, no q/k/v bias, a ``head_dim`` of its own (not ``hidden_size / heads``) and,
when ``use_sliding_window`` is set, sliding-window attention from layer ``max_window_layers`` on.
"""

from collections.abc import Mapping
from typing import Any

import torch

from tunelab.models.args import (
    FULL,
    SLIDING,
    ModelArgs,
    args_from_hf_config,
    common_hf_config,
    layer_types_from_hf,
)
from tunelab.models.state_dict_adapter import StateDictAdapter


class Qwen3StateDictAdapter(StateDictAdapter):
    """Qwen3 keys are the native names (``self_attn.q_norm.weight`` included)."""

    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``Qwen3Config`` dict (see ``StateDictAdapter.hf_config``)."""
        args = self.args
        config = common_hf_config(args)
        config["attention_bias"] = args.qkv_bias
        config.update(sliding_window_hf_config(args))
        config["use_sliding_window"] = args.layer_types is not None
        if args.layer_types is not None:
            config["max_window_layers"] = args.layer_types.index(SLIDING)
        return self._with_identity(config, torch_dtype)


def sliding_window_hf_config(args: ModelArgs) -> dict[str, Any]:
    """``sliding_window`` and, when some layer slides, ``layer_types`` for an HF config."""
    config: dict[str, Any] = {"sliding_window": args.sliding_window}
    if args.layer_types is not None:
        config["layer_types"] = list(args.layer_types)
    return config


def qwen3_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a Qwen3 ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments.
    """
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    first_sliding = int(config.get("max_window_layers", 28))
    num_layers = int(config.get("num_hidden_layers", 0))
    default = [SLIDING if i >= first_sliding else FULL for i in range(num_layers)]
    attention_bias = bool(config.get("attention_bias", False))
    return args_from_hf_config(
        config,
        "qwen3",
        head_dim=int(config.get("head_dim") or 128),
        qkv_bias=attention_bias,
        output_bias=attention_bias,
        qk_norm=True,
        sliding_window=window,
        layer_types=layer_types_from_hf(config, window, default),
    )
