"""The Gemma 2 and Gemma 3 (text) families: HF config parsing and key mapping.

Both scale the embeddings by ``sqrt(hidden_size)``, use RMSNorm with a ``1 + weight`` scale,
norm the outputs of attention and MLP as well as their inputs, gate the MLP with tanh-GELU,
scale attention by ``query_pre_attn_scalar ** -0.5``, tie the embeddings and alternate
sliding-window and global layers. Gemma 2 soft-caps the attention and final logits. Gemma 3
adds ``q_norm``/``k_norm`` and rotates its sliding-window layers with their own base
(``rope_local_base_freq``, or ``rope_parameters["sliding_attention"]`` in transformers 5).

Gemma 3's ``attn_logit_softcapping`` is ignored, as transformers ignores it (4.56 and 5.24
never pass it to attention; the released checkpoints set it to null); its final soft-cap
applies.
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
    layer_types_from_hf,
    rope_from_hf,
)
from tunelab.models.qwen3 import sliding_window_hf_config
from tunelab.models.state_dict_adapter import StateDictAdapter


class Gemma2StateDictAdapter(StateDictAdapter):
    """Gemma 2 keys are the native names (``pre_feedforward_layernorm`` and the rest)."""

    model_type = "gemma2"
    architecture = "Gemma2ForCausalLM"

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``Gemma2Config`` dict (see ``StateDictAdapter.hf_config``)."""
        return self._with_identity(_gemma_hf_config(self.args), torch_dtype)


class Gemma3TextStateDictAdapter(StateDictAdapter):
    """Gemma 3 text keys are the native names (``self_attn.q_norm.weight`` included)."""

    model_type = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    # Gemma3ForSequenceClassification is the multimodal model's; the text-only one is this.
    classifier_architecture = "Gemma3TextForSequenceClassification"

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``Gemma3TextConfig`` dict (see ``StateDictAdapter.hf_config``)."""
        config = _gemma_hf_config(self.args)
        config["rope_local_base_freq"] = self.args.rope_local_theta
        return self._with_identity(config, torch_dtype)


def _gemma_hf_config(args: ModelArgs) -> dict[str, Any]:
    config = common_hf_config(args)
    config.update(sliding_window_hf_config(args))
    config["hidden_activation"] = args.hidden_act
    config["attention_bias"] = args.qkv_bias
    scalar = args.query_pre_attn_scalar
    # transformers 5 types the field as int (it is one in every released config).
    config["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar
    config["attn_logit_softcapping"] = args.attn_logit_softcap
    config["final_logit_softcapping"] = args.final_logit_softcap
    return config


def _gemma_args(
    config: Mapping[str, Any],
    family: str,
    default_types: list[str],
    default_softcaps: tuple[float | None, float | None],
    **overrides: Any,
) -> ModelArgs:
    window = config.get("sliding_window", 4096)
    attention_bias = bool(config.get("attention_bias", False))
    return args_from_hf_config(
        config,
        family,
        head_dim=int(config.get("head_dim") or 256),
        hidden_act=str(config.get("hidden_activation") or "gelu_pytorch_tanh"),
        qkv_bias=attention_bias,
        output_bias=attention_bias,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        norm_unit_offset=True,
        sandwich_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=config.get("attn_logit_softcapping", default_softcaps[0]),
        final_logit_softcap=config.get("final_logit_softcapping", default_softcaps[1]),
        sliding_window=window,
        layer_types=layer_types_from_hf(config, window, default_types),
        **overrides,
    )


def gemma2_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a Gemma 2 ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments.
    """
    num_layers = int(config.get("num_hidden_layers", 0))
    # Checkpoints older than `layer_types` alternate, starting with a sliding layer.
    default = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    return _gemma_args(config, "gemma2", default, (50.0, 30.0))


def gemma3_text_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a Gemma 3 text (``Gemma3ForCausalLM``) ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments.

    Raises:
        ConfigError: bidirectional attention, or scaled RoPE on the local layers.
    """
    if config.get("use_bidirectional_attention"):
        raise ConfigError("Gemma 3 use_bidirectional_attention=true is not supported")
    num_layers = int(config.get("num_hidden_layers", 0))
    pattern = int(config.get("sliding_window_pattern", 6))
    default = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    config = {**config, "attn_logit_softcapping": None}  # see the module docstring
    parameters = config.get("rope_parameters") or {}
    if FULL in parameters or SLIDING in parameters:  # transformers 5: one dict per layer kind
        theta, scaling = rope_from_hf({"rope_theta": 1_000_000.0}, parameters.get(FULL))
        local, local_scaling = rope_from_hf({}, parameters.get(SLIDING))
        if local_scaling is not None:
            raise ConfigError(
                f"Gemma 3 rope_parameters[{SLIDING!r}] with scaling is not supported: "
                f"{local_scaling}"
            )
    else:
        theta, scaling = rope_from_hf({"rope_theta": 1_000_000.0, **config})
        local = float(config.get("rope_local_base_freq", 10_000.0))
    return _gemma_args(
        config,
        "gemma3_text",
        default,
        (None, None),
        qk_norm=True,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local,
    )
