"""The Qwen3-VL family (dense): HF config parsing and key mapping.

The language model is Qwen3's (per-head q/k RMSNorm, no q/k/v bias) with interleaved
multimodal rotary positions and deepstack features added after its first layers; the vision
tower is ``tunelab.modules.vision_qwen3.Qwen3VisionTransformer``.

Hub checkpoints (and transformers 5's ``save_pretrained``) keep the keys
``model.language_model.*``, ``model.visual.*`` and ``lm_head.weight``; the native names are
``model.*`` and ``visual.*`` as for Qwen2.5-VL, so one ``VisionLanguageDecoder`` serves both.
A ``config.json`` keeps the language model's keys under ``text_config``, the rotary sections
under its ``rope_scaling`` or ``rope_parameters``.
"""

from collections.abc import Mapping
from typing import Any

import torch

from tunelab.errors import ConfigError
from tunelab.models.args import ModelArgs, args_from_hf_config, common_hf_config
from tunelab.models.qwen2_5_vl import (
    TOKEN_KEYS,
    mrope_section_from_hf,
    vision_args_from_hf,
    vision_hf_config,
    without_mrope,
)
from tunelab.models.state_dict_adapter import StateDictAdapter
from tunelab.modules.feed_forward import ACTIVATIONS

_LANGUAGE_MODEL = "model.language_model."
_VISUAL = "model.visual."


class Qwen3VLStateDictAdapter(StateDictAdapter):
    """Native ``model.*`` / ``visual.*`` to the hub's ``model.language_model.*`` / ``model.visual.*``."""

    model_type = "qwen3_vl"
    architecture = "Qwen3VLForConditionalGeneration"

    def to_hf_key(self, native_key: str) -> str:
        """``visual.x`` to ``model.visual.x``, ``model.x`` to ``model.language_model.x``."""
        if native_key.startswith("visual."):
            return "model." + native_key
        if native_key.startswith("model."):
            return _LANGUAGE_MODEL + native_key.removeprefix("model.")
        return native_key

    def from_hf_key(self, hf_key: str) -> str:
        """The inverse of ``to_hf_key``."""
        if hf_key.startswith(_VISUAL):
            return hf_key.removeprefix("model.")
        if hf_key.startswith(_LANGUAGE_MODEL):
            return "model." + hf_key.removeprefix(_LANGUAGE_MODEL)
        return hf_key

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``Qwen3VLConfig`` dict in the hub's layout (language keys in ``text_config``)."""
        args = self.args
        vision = args.vision
        assert vision is not None and args.mrope_section is not None
        text = common_hf_config(args)
        text.pop("tie_word_embeddings")
        text["rope_scaling"] = {
            "rope_type": "default",
            "mrope_section": list(args.mrope_section),
            "mrope_interleaved": True,
        }
        text["attention_bias"] = False
        config = {
            "text_config": {**text, "model_type": "qwen3_vl_text"},
            "vision_config": {
                "model_type": "qwen3_vl_vision",
                **vision_hf_config(vision),
                "num_position_embeddings": vision.num_position_embeddings,
                "deepstack_visual_indexes": list(vision.deepstack_blocks),
                "rope_parameters": {"rope_type": "axial", "rope_theta": vision.rope_theta},
            },
            "tie_word_embeddings": args.tie_embeddings,
            **{key: getattr(vision, key) for key in TOKEN_KEYS},
        }
        return self._with_identity(config, torch_dtype)


def qwen3_vl_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a Qwen3-VL ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments, ``vision``, ``mrope_section`` and ``mrope_interleaved`` set.

    Raises:
        ConfigError: a missing key, an unsupported activation, more deepstack features than
            language layers, or a rotary scaling other than plain M-RoPE.
    """
    text = dict(config.get("text_config") or {})
    for key, value in config.items():
        if key not in ("text_config", "vision_config"):
            text.setdefault(key, value)
    section = mrope_section_from_hf(text, "Qwen3-VL")

    def own_fields(vision_config: Mapping[str, Any]) -> dict[str, Any]:
        hidden_act = str(vision_config.get("hidden_act", "gelu_pytorch_tanh"))
        if hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"Qwen3-VL vision_config hidden_act {hidden_act!r} is not supported; "
                f"supported: {sorted(ACTIVATIONS)}"
            )
        return dict(
            layout="qwen3_vl",
            patch_size=int(vision_config.get("patch_size", 16)),
            hidden_act=hidden_act,
            num_position_embeddings=int(vision_config["num_position_embeddings"]),
            deepstack_blocks=list(vision_config.get("deepstack_visual_indexes", [])),
        )

    vision = vision_args_from_hf(config, "Qwen3-VL", own_fields)
    args = args_from_hf_config(
        without_mrope(text),
        "qwen3_vl",
        head_dim=int(text.get("head_dim") or 128),
        qkv_bias=bool(text.get("attention_bias", False)),
        output_bias=bool(text.get("attention_bias", False)),
        qk_norm=True,
        mrope_section=section,
        mrope_interleaved=True,
        vision=vision,
    )
    if args.rope_scaling is not None:
        raise ConfigError(
            f"Qwen3-VL rotary scaling {args.rope_scaling.get('rope_type')!r} is not supported"
        )
    if len(vision.deepstack_blocks) > args.num_layers:
        raise ConfigError(
            f"Qwen3-VL has {len(vision.deepstack_blocks)} deepstack features but "
            f"{args.num_layers} language layers to add them to"
        )
    return args
