"""The Llama family (Llama 2, 3, 3.1, 3.2): HF config parsing and key mapping.

A model is built from its checkpoint's ``config.json`` (``tunelab.models.from_hf_config``).
"""

from collections.abc import Mapping
from typing import Any

import torch

from tunelab.models.args import ModelArgs, args_from_hf_config, common_hf_config
from tunelab.models.state_dict_adapter import StateDictAdapter


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
