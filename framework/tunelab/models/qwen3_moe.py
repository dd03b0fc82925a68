"""The Qwen3-MoE family (Qwen3-30B-A3B, 235B-A22B): HF config parsing and key mapping.

Qwen3-MoE is the Qwen3 block (q/k norm, no bias) whose feed-forward is a mixture of experts
(``tunelab.modules.moe``): a top-k softmax router (``mlp.gate``), with the top-k weights
renormalised when ``norm_topk_prob``, over ``num_experts`` SwiGLU experts of hidden size
``moe_intermediate_size``. Layers listed in ``mlp_only_layers``, and those not on the
``decoder_sparse_step`` grid, keep a dense MLP of ``intermediate_size``. With
``use_sliding_window`` every layer attends within ``sliding_window`` (transformers 5).
"""

from collections.abc import Mapping
from typing import Any

import torch

from tunelab.models.args import (
    ModelArgs,
    args_from_hf_config,
    common_hf_config,
    experts_from_hf,
)
from tunelab.models.mistral import every_layer_slides
from tunelab.models.state_dict_adapter import MoEStateDictAdapter


class Qwen3MoeStateDictAdapter(MoEStateDictAdapter):
    """Qwen3-MoE keys: native names, experts one tensor each (``mlp.experts.N.gate_proj``)."""

    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``Qwen3MoeConfig`` dict (see ``StateDictAdapter.hf_config``)."""
        args = self.args
        config = common_hf_config(args)
        config.update(
            attention_bias=args.qkv_bias,
            use_sliding_window=args.layer_types is not None,
            sliding_window=args.sliding_window,
            max_window_layers=args.num_layers,
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_dim,
            norm_topk_prob=args.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=list(args.dense_layers),
            router_aux_loss_coef=args.router_aux_loss_coef,
            output_router_logits=args.output_router_logits,
        )
        return self._with_identity(config, torch_dtype)


def dense_layers_from_hf(config: Mapping[str, Any], num_experts: int) -> list[int]:
    """The layers that keep a dense MLP: ``mlp_only_layers`` and those off the sparse grid."""
    step = int(config.get("decoder_sparse_step") or 1)
    only = set(config.get("mlp_only_layers") or [])
    return [
        index
        for index in range(int(config.get("num_hidden_layers", 0)))
        if index in only or not (num_experts > 0 and (index + 1) % step == 0)
    ]


def qwen3_moe_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a Qwen3-MoE ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments.
    """
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    attention_bias = bool(config.get("attention_bias", False))
    num_experts, num_experts_per_tok = experts_from_hf(config, "qwen3_moe")
    return args_from_hf_config(
        config,
        "qwen3_moe",
        qkv_bias=attention_bias,
        output_bias=attention_bias,
        qk_norm=True,
        sliding_window=window,
        layer_types=every_layer_slides(config, window),
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_dim=int(config.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        dense_layers=dense_layers_from_hf(config, num_experts),
        router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(config.get("output_router_logits", False)),
    )
