"""The gpt-oss family (gpt-oss-20b, gpt-oss-120b): HF config parsing and key mapping.

gpt-oss (OpenAI, 2025, https://arxiv.org/abs/2508.10925) is a decoder whose every layer is a
mixture of experts, with:

- attention with biases on q/k/v/o and a learned sink logit per head
  (``self_attn.sinks``), alternating sliding-window (``sliding_window``, 128) and full
  layers (``layer_types``), rotated with YaRN (``rope_parameters``);
- a router with a bias (hub ``mlp.router``, native ``mlp.gate``): the top-k of its logits,
  softmaxed over those k (the renormalised top-k softmax);
- experts held as transformers' ``GptOssExperts`` holds them (``expert_layout="gpt_oss"``):
  ``mlp.experts.gate_up_proj`` ``[E, D, 2I]`` with the gate and up columns interleaved,
  ``gate_up_proj_bias`` ``[E, 2I]``, ``down_proj`` ``[E, I, D]``, ``down_proj_bias``
  ``[E, D]``, gated by a clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``).

The hub's checkpoints store the expert weights in MXFP4 (``gate_up_proj_blocks`` /
``_scales``, ``tunelab.formats.mxfp4``); they are dequantized on load, each rank reading
only its own experts. Exports are never quantized: they hold the dequantized weights under
the plain names, as transformers saves a dequantized gpt-oss, and no ``quantization_config``.
"""

from collections.abc import Mapping
from typing import Any

import torch

from tunelab.errors import ConfigError
from tunelab.models.args import (
    FULL,
    SLIDING,
    ModelArgs,
    args_from_hf_config,
    common_hf_config,
    experts_from_hf,
    layer_types_from_hf,
)
from tunelab.models.state_dict_adapter import StateDictAdapter

_HUB_ROUTER, _NATIVE_ROUTER = ".mlp.router.", ".mlp.gate."
_QUANTIZED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


class GptOssStateDictAdapter(StateDictAdapter):
    """gpt-oss keys: the native names, but the router is ``mlp.router``; MXFP4 experts."""

    model_type = "gpt_oss"
    architecture = "GptOssForCausalLM"

    def to_hf_key(self, native_key: str) -> str:
        """``mlp.gate`` (native router) becomes ``mlp.router``."""
        return native_key.replace(_NATIVE_ROUTER, _HUB_ROUTER)

    def from_hf_key(self, hf_key: str) -> str:
        """Inverse of ``to_hf_key``."""
        return hf_key.replace(_HUB_ROUTER, _NATIVE_ROUTER)

    def mxfp4_hf_keys(self, hf_key: str) -> tuple[str, str] | None:
        """``(key_blocks, key_scales)`` for the expert weights (see ``StateDictAdapter``)."""
        if hf_key.endswith(_QUANTIZED_EXPERTS):
            return f"{hf_key}_blocks", f"{hf_key}_scales"
        return None

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``GptOssConfig`` dict (see ``StateDictAdapter.hf_config``)."""
        args = self.args
        config = common_hf_config(args)
        config.update(
            intermediate_size=args.moe_intermediate_dim,
            attention_bias=args.qkv_bias,
            attention_dropout=0.0,
            sliding_window=args.sliding_window,
            layer_types=[args.layer_type(index) for index in range(args.num_layers)],
            num_local_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            swiglu_limit=None if args.swiglu_limit == float("inf") else args.swiglu_limit,
            swiglu_alpha=args.swiglu_alpha,
            router_aux_loss_coef=args.router_aux_loss_coef,
            output_router_logits=args.output_router_logits,
        )
        return self._with_identity(config, torch_dtype)


def gpt_oss_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a gpt-oss ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments.

    Raises:
        ConfigError: attention dropout, no attention bias, or a quantization other than
            MXFP4.
    """
    quantization = config.get("quantization_config") or {}
    if quantization and quantization.get("quant_method") != "mxfp4":
        raise ConfigError(
            f"gpt-oss quantization_config quant_method {quantization.get('quant_method')!r} is "
            "not supported; tunelab reads MXFP4 experts (dequantized on load) or plain weights"
        )
    if float(config.get("attention_dropout") or 0.0) != 0.0:
        raise ConfigError(
            f"attention_dropout {config['attention_dropout']} is not supported; set it to 0.0"
        )
    num_layers = int(config.get("num_hidden_layers", 0))
    window = config.get("sliding_window", 128)
    # Configs without `layer_types` alternate, starting with a sliding layer (transformers).
    default = [SLIDING if (index + 1) % 2 else FULL for index in range(num_layers)]
    attention_bias = bool(config.get("attention_bias", True))
    num_experts, num_experts_per_tok = experts_from_hf(config, "gpt_oss")
    swiglu_limit = config.get("swiglu_limit", 7.0)
    return args_from_hf_config(
        config,
        "gpt_oss",
        head_dim=int(config.get("head_dim") or 64),
        qkv_bias=attention_bias,
        output_bias=attention_bias,
        attention_sinks=True,
        norm_scale_in_fp32=True,
        sliding_window=window,
        layer_types=layer_types_from_hf(config, window, default),
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_dim=int(config["intermediate_size"]),
        norm_topk_prob=True,
        router_bias=True,
        expert_bias=True,
        expert_layout="gpt_oss",
        # transformers clamps nothing when it is null but keeps the rest of the gate.
        swiglu_limit=float("inf") if swiglu_limit is None else float(swiglu_limit),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(config.get("output_router_logits", False)),
    )
