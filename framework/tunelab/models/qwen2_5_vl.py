"""The Qwen2.5-VL family: HF config parsing and key mapping.

The language model is Qwen2's (q/k/v biases) with multimodal rotary positions; the vision
tower is ``tunelab.modules.vision.VisionTransformer``. Hub checkpoints (and transformers 5's
``save_pretrained``) keep the keys ``visual.*``, ``model.*`` and ``lm_head.weight``, which are
the native names: the mapping is the identity.

A ``config.json`` keeps the language model's keys under ``text_config`` (transformers 5) or
at the top level (the original hub files, transformers 4); the rotary sections under
``rope_parameters`` or ``rope_scaling`` (``{"type": "mrope", "mrope_section": [...]}``).
"""

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tunelab.errors import ConfigError
from tunelab.models.args import ModelArgs, VisionArgs, args_from_hf_config, common_hf_config
from tunelab.models.state_dict_adapter import StateDictAdapter

TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


class Qwen2_5_VLStateDictAdapter(StateDictAdapter):
    """Qwen2.5-VL keys are the native names (the hub layout)."""

    model_type = "qwen2_5_vl"
    architecture = "Qwen2_5_VLForConditionalGeneration"

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``Qwen2_5_VLConfig`` dict, language keys at the top level and in ``text_config``."""
        args = self.args
        vision = args.vision
        assert vision is not None and args.mrope_section is not None
        text = common_hf_config(args)
        text["rope_scaling"] = {
            "type": "mrope",
            "rope_type": "default",
            "mrope_section": list(args.mrope_section),
        }
        text["use_sliding_window"] = False
        config = {
            **text,
            "text_config": {**text, "model_type": "qwen2_5_vl_text"},
            "vision_config": {
                "model_type": "qwen2_5_vl_vision",
                **vision_hf_config(vision),
                "window_size": vision.window_size,
                "fullatt_block_indexes": list(vision.full_attention_blocks),
                "tokens_per_second": vision.tokens_per_second,
            },
            **{key: getattr(vision, key) for key in TOKEN_KEYS},
        }
        return self._with_identity(config, torch_dtype)


def vision_hf_config(vision: VisionArgs) -> dict[str, Any]:
    """The ``vision_config`` keys the Qwen2.5-VL and Qwen3-VL towers share."""
    return {
        "depth": vision.depth,
        "hidden_size": vision.dim,
        "intermediate_size": vision.intermediate_dim,
        "num_heads": vision.num_heads,
        "out_hidden_size": vision.out_dim,
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "spatial_merge_size": vision.spatial_merge_size,
        "in_channels": vision.in_channels,
        "hidden_act": vision.hidden_act,
    }


def vision_args_from_hf(
    config: Mapping[str, Any],
    family: str,
    own_fields: Callable[[Mapping[str, Any]], dict[str, Any]],
) -> VisionArgs:
    """A Qwen vision tower's shape from a ``config.json``'s ``vision_config``.

    Args:
        config: the parsed file (the token ids are at its top level).
        family: the family's name, for errors.
        own_fields: the family's own ``VisionArgs`` fields from the ``vision_config``
            (``layout``, ``patch_size``, ``hidden_act``, windows or deepstack).

    Returns:
        The tower's arguments.

    Raises:
        ConfigError: no ``vision_config``, or a required key missing from it.
    """
    vision_config = config.get("vision_config")
    if not isinstance(vision_config, Mapping):
        raise ConfigError(f"{family} config.json has no vision_config")
    text = config.get("text_config") or config
    try:
        return VisionArgs(
            depth=int(vision_config["depth"]),
            dim=int(vision_config["hidden_size"]),
            intermediate_dim=int(vision_config["intermediate_size"]),
            num_heads=int(vision_config["num_heads"]),
            out_dim=int(vision_config.get("out_hidden_size", text["hidden_size"])),
            temporal_patch_size=int(vision_config.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision_config.get("spatial_merge_size", 2)),
            in_channels=int(vision_config.get("in_channels", 3)),
            rope_theta=float((vision_config.get("rope_parameters") or {}).get("rope_theta", 1e4)),
            **{key: int(config[key]) for key in TOKEN_KEYS if key in config},
            **own_fields(vision_config),
        )
    except KeyError as missing:
        raise ConfigError(f"{family} vision_config has no {missing.args[0]!r}") from None


def mrope_section_from_hf(text: Mapping[str, Any], family: str) -> list[int]:
    """The M-RoPE ``mrope_section`` of a text config (``rope_parameters`` or ``rope_scaling``).

    Args:
        text: the language model's config keys.
        family: the family's name, for the error.

    Raises:
        ConfigError: neither holds one.
    """
    for key in ("rope_parameters", "rope_scaling"):
        section = (text.get(key) or {}).get("mrope_section")
        if section is not None:
            return [int(size) for size in section]
    raise ConfigError(f"{family} config.json has no mrope_section (rope_parameters)")


def without_mrope(text: Mapping[str, Any]) -> dict[str, Any]:
    """The text config with its M-RoPE markers removed (the frequencies are plain RoPE's)."""
    text = dict(text)
    for key in ("rope_parameters", "rope_scaling"):
        rope = dict(text.get(key) or {})
        rope.pop("mrope_section", None)
        rope.pop("mrope_interleaved", None)
        if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
            rope.pop("type", None)
            rope["rope_type"] = "default"
        text[key] = rope or None
    return text


def qwen2_5_vl_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a Qwen2.5-VL ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments, ``vision`` and ``mrope_section`` set.

    Raises:
        ConfigError: a missing key, sliding-window attention, or a rotary scaling other than
            plain M-RoPE.
    """
    text = dict(config.get("text_config") or {})
    for key, value in config.items():
        text.setdefault(key, value)
    if text.get("use_sliding_window", False):
        raise ConfigError("Qwen2.5-VL use_sliding_window=true is not supported")
    section = mrope_section_from_hf(text, "Qwen2.5-VL")
    vision = vision_args_from_hf(
        config,
        "Qwen2.5-VL",
        lambda vision_config: dict(
            patch_size=int(vision_config.get("patch_size", 14)),
            window_size=int(vision_config.get("window_size", 112)),
            full_attention_blocks=list(vision_config.get("fullatt_block_indexes", [])),
            hidden_act=str(vision_config.get("hidden_act", "silu")),
            tokens_per_second=int(vision_config.get("tokens_per_second", 4)),
        ),
    )
    args = args_from_hf_config(
        without_mrope(text), "qwen2_5_vl", qkv_bias=True, mrope_section=section, vision=vision
    )
    if args.rope_scaling is not None:
        raise ConfigError(
            f"Qwen2.5-VL rotary scaling {args.rope_scaling.get('rope_type')!r} is not supported"
        )
    return args
