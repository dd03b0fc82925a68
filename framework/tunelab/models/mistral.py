"""The Mistral family (7B v0.1-v0.3, Nemo 12B): HF config parsing and key mapping.

Mistral is the Llama block with sliding-window attention in every layer when
``sliding_window`` is set (v0.1; null from v0.2 on) and a ``head_dim`` that need not be
``hidden_size / heads`` (Nemo: 5120 / 32 heads, head_dim 128).
"""

from collections.abc import Mapping
from typing import Any

import torch

from tunelab.models.args import SLIDING, ModelArgs, args_from_hf_config, common_hf_config
from tunelab.models.state_dict_adapter import StateDictAdapter


class MistralStateDictAdapter(StateDictAdapter):
    """Mistral keys are the native names."""

    model_type = "mistral"
    architecture = "MistralForCausalLM"

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``MistralConfig`` dict (see ``StateDictAdapter.hf_config``)."""
        config = common_hf_config(self.args)
        config["sliding_window"] = self.args.sliding_window
        return self._with_identity(config, torch_dtype)


def every_layer_slides(config: Mapping[str, Any], window: int | None) -> list[str] | None:
    """``layer_types`` for a family whose window, when set, applies to every layer."""
    return None if window is None else [SLIDING] * int(config.get("num_hidden_layers", 0))


def mistral_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a Mistral ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments.
    """
    # transformers' MistralConfig defaults to a 4096 window when the key is absent.
    window = config.get("sliding_window", 4096)
    return args_from_hf_config(
        config, "mistral", sliding_window=window, layer_types=every_layer_slides(config, window)
    )
