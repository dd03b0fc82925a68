"""The Phi-3 family (Phi-3, Phi-3.5-mini, Phi-4-mini): HF config parsing and key mapping.

Phi-3 checkpoints fuse the attention input projections into ``qkv_proj`` (rows: q, then k,
then v) and the MLP's gate and up projections into ``gate_up_proj`` (gate rows first). The
model keeps those modules, so the weights load as they are and LoRA on ``qkv_proj`` is PEFT's
LoRA on ``qkv_proj``. Phi-4-mini rotates only part of each head (``partial_rotary_factor``);
the 128k-context models use LongRoPE (``rope_scaling`` type ``longrope``).
"""

from collections.abc import Mapping
from typing import Any

import torch

from tunelab.models.args import (
    ModelArgs,
    args_from_hf_config,
    common_hf_config,
    partial_rotary_from_hf,
    rope_from_hf,
)
from tunelab.models.mistral import every_layer_slides
from tunelab.models.state_dict_adapter import StateDictAdapter


class Phi3StateDictAdapter(StateDictAdapter):
    """Phi-3 keys are the native names (``qkv_proj``, ``gate_up_proj``)."""

    model_type = "phi3"
    architecture = "Phi3ForCausalLM"

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``Phi3Config`` dict (see ``StateDictAdapter.hf_config``).

        LongRoPE is written as transformers 4 requires it (exactly ``type``, ``short_factor``
        and ``long_factor``, with ``original_max_position_embeddings`` at the top level);
        transformers 5 reads that layout too.
        """
        args = self.args
        config = common_hf_config(args)
        config["sliding_window"] = args.sliding_window
        config["partial_rotary_factor"] = args.partial_rotary_factor
        config["original_max_position_embeddings"] = args.max_seq_len
        scaling = args.rope_scaling
        if scaling is not None and scaling.get("rope_type") == "longrope":
            config["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
            config["rope_scaling"] = {
                "type": "longrope",
                "short_factor": list(scaling["short_factor"]),
                "long_factor": list(scaling["long_factor"]),
            }
        return self._with_identity(config, torch_dtype)


def phi3_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a Phi-3 ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments.
    """
    window = config.get("sliding_window")
    theta, scaling = rope_from_hf(config)
    if scaling is not None and scaling["rope_type"] == "yarn":
        # transformers' Phi3Config reads an old Phi-3 "yarn" as LongRoPE (its short/long
        # factors); rope_from_hf resolved the lengths and factor alike for both types.
        scaling["rope_type"] = "longrope"
    return args_from_hf_config(
        config,
        "phi3",
        fused_projections=True,
        partial_rotary_factor=partial_rotary_from_hf(config),
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=window,
        layer_types=every_layer_slides(config, window),
    )
