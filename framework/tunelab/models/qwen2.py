"""The Qwen2 / Qwen2.5 family: HF config parsing and key mapping.

Qwen2 is the Llama block with a bias on the q/k/v projections (none on ``o_proj``) and, on the
small sizes, tied embeddings.
"""

from collections.abc import Mapping
from typing import Any

import torch

from tunelab.errors import ConfigError
from tunelab.models.args import ModelArgs, args_from_hf_config, common_hf_config
from tunelab.models.state_dict_adapter import StateDictAdapter


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
