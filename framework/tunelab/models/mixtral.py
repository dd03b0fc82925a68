"""The Mixtral family (8x7B, 8x22B): HF config parsing and key mapping.

Mixtral is the Mistral block (sliding-window attention in every layer when ``sliding_window``
is set) whose feed-forward is a mixture of ``num_local_experts`` SwiGLU experts of hidden size
``intermediate_size`` (``tunelab.modules.moe``), each token routed to the top
``num_experts_per_tok`` (2) with the two weights renormalised. Hub checkpoints name the block
``block_sparse_moe`` and the expert projections ``w1`` (gate), ``w3`` (up) and ``w2`` (down).
"""

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from tunelab.errors import ConfigError
from tunelab.models.args import (
    ModelArgs,
    args_from_hf_config,
    common_hf_config,
    experts_from_hf,
)
from tunelab.models.mistral import every_layer_slides
from tunelab.models.state_dict_adapter import MoEStateDictAdapter


class MixtralStateDictAdapter(MoEStateDictAdapter):
    """Mixtral keys: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.N.w1/w3/w2``."""

    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    hf_moe_module: ClassVar[str] = "block_sparse_moe"
    hf_expert_projections: ClassVar[dict[str, tuple[str, ...]]] = {
        "gate_up_proj": ("w1", "w3"),
        "down_proj": ("w2",),
    }

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``MixtralConfig`` dict (see ``StateDictAdapter.hf_config``)."""
        args = self.args
        config = common_hf_config(args)
        config["intermediate_size"] = args.moe_intermediate_dim
        config.update(
            sliding_window=args.sliding_window,
            num_local_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            router_aux_loss_coef=args.router_aux_loss_coef,
            router_jitter_noise=0.0,
            output_router_logits=args.output_router_logits,
        )
        return self._with_identity(config, torch_dtype)


def mixtral_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a Mixtral ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments.

    Raises:
        ConfigError: ``router_jitter_noise`` is set (multiplicative router noise in training
            is not implemented).
    """
    if float(config.get("router_jitter_noise") or 0.0) != 0.0:
        raise ConfigError(
            f"router_jitter_noise {config['router_jitter_noise']} is not supported; set it to 0.0"
        )
    num_experts, num_experts_per_tok = experts_from_hf(config, "mixtral")
    window = config.get("sliding_window")
    return args_from_hf_config(
        config,
        "mixtral",
        sliding_window=window,
        layer_types=every_layer_slides(config, window),
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_dim=int(config["intermediate_size"]),
        norm_topk_prob=True,
        router_weights_in_fp32=True,
        router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(config.get("output_router_logits", False)),
    )
