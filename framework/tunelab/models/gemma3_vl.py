"""The Gemma 3 multimodal family (``Gemma3ForConditionalGeneration``): config and key mapping.

The language model is Gemma 3's (``tunelab.models.gemma``); the vision tower is SigLIP and the
projector average-pools its patches into ``mm_tokens_per_image`` soft tokens
(``tunelab.modules.vision_siglip``). The decoder that joins them is
``tunelab.models.vision_language_gemma3.Gemma3VisionLanguageDecoder``.

Native names are ``model.*`` (the language model), ``vision_tower.*`` (transformers 5's module
names: ``embeddings``, ``encoder.layers``, ``post_layernorm``), ``multi_modal_projector.*`` and
``lm_head.weight``. Hub checkpoints keep ``language_model.model.*``,
``vision_tower.vision_model.*``, ``multi_modal_projector.*`` and, untied,
``language_model.lm_head.weight``; exports are written so.
transformers 5's ``save_pretrained`` drops ``vision_model.`` from the tower's keys: such a file
is read too. transformers' ``Gemma3ForConditionalGeneration`` applies no final logit soft-cap
(4.5x and 5.x): neither does this family, whatever ``final_logit_softcapping`` says.
"""

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from tunelab.errors import ConfigError
from tunelab.models.args import ModelArgs
from tunelab.models.gemma import Gemma3TextStateDictAdapter, gemma3_text_args_from_hf
from tunelab.models.state_dict_adapter import EMBEDDING_KEY, TIED_HEAD_KEY, StateDictAdapter
from tunelab.modules.feed_forward import ACTIVATIONS
from tunelab.modules.vision import VisionArgs

_LANGUAGE = "language_model.model."
_HUB_TOWER = "vision_tower.vision_model."
_TOWER = "vision_tower."
_PROJECTOR = "multi_modal_projector."
# Gemma3TextConfig's and SiglipVisionConfig's defaults, for keys a hub config leaves out.
_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
}
_VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "vision_use_head": True,
}


class Gemma3VLStateDictAdapter(StateDictAdapter):
    """Native names to the hub's ``language_model.model.*`` / ``vision_tower.vision_model.*``.

    Args:
        args: the model's arguments.
        tower_prefix: the tower's key prefix in the file: the hub's ``vision_tower.vision_model.``
            or transformers 5's ``vision_tower.`` (``for_file_keys`` picks it).
    """

    model_type = "gemma3"
    architecture = "Gemma3ForConditionalGeneration"

    def __init__(self, args: ModelArgs, tower_prefix: str = _HUB_TOWER) -> None:
        super().__init__(args)
        self.tower_prefix = tower_prefix

    def for_file_keys(self, keys: Iterable[str]) -> "Gemma3VLStateDictAdapter":
        """The adapter of a file holding these keys (transformers 5's tower keys or the hub's)."""
        keys = list(keys)
        hub = any(key.startswith(_HUB_TOWER) for key in keys)
        saved = any(key.startswith(_TOWER) for key in keys)
        return self if hub or not saved else Gemma3VLStateDictAdapter(self.args, _TOWER)

    def to_hf_key(self, native_key: str) -> str:
        """The hub's key: under ``language_model.`` (``model.*``, ``lm_head.*``), the tower's."""
        if native_key.startswith("model."):
            return _LANGUAGE + native_key.removeprefix("model.")
        if native_key.startswith("lm_head."):
            return "language_model." + native_key
        if native_key.startswith(_TOWER):
            return self.tower_prefix + native_key.removeprefix(_TOWER)
        return native_key

    def tied_hf_keys(self) -> dict[str, str]:
        """The tied output layer's key (``language_model.lm_head.weight``) and its partner."""
        if not self.args.tie_embeddings:
            return {}
        return {self.to_hf_key(TIED_HEAD_KEY): self.to_hf_key(EMBEDDING_KEY)}

    def from_hf_key(self, hf_key: str) -> str:
        """The inverse of ``to_hf_key``; also reads transformers' module paths (``model.*``)."""
        for prefix, native in (
            (_LANGUAGE, "model."),
            ("model.language_model.", "model."),
            (_HUB_TOWER, _TOWER),
            ("model.vision_tower.", _TOWER),
            ("model.multi_modal_projector.", _PROJECTOR),
            ("language_model.lm_head.", "lm_head."),
            ("model.lm_head.", "lm_head."),
        ):
            if hf_key.startswith(prefix):
                return native + hf_key.removeprefix(prefix)
        return hf_key

    def hf_config(self, torch_dtype: torch.dtype | None = None) -> dict[str, Any]:
        """A ``Gemma3Config`` dict, the language's keys in ``text_config``, SigLIP's apart."""
        args, vision = self.args, self.args.vision
        assert vision is not None
        text = Gemma3TextStateDictAdapter(args).hf_config()
        for key in ("architectures", "model_type"):
            text.pop(key, None)
        config = {
            "text_config": {**text, "model_type": "gemma3_text"},
            "vision_config": {
                "model_type": "siglip_vision_model",
                "hidden_size": vision.dim,
                "intermediate_size": vision.intermediate_dim,
                "num_hidden_layers": vision.depth,
                "num_attention_heads": vision.num_heads,
                "num_channels": vision.in_channels,
                "image_size": vision.image_size,
                "patch_size": vision.patch_size,
                "hidden_act": vision.hidden_act,
                "layer_norm_eps": vision.norm_eps,
                "vision_use_head": False,
            },
            "mm_tokens_per_image": vision.tokens_per_image,
            "image_token_index": vision.image_token_id,
            "boi_token_index": vision.vision_start_token_id,
            "eoi_token_index": vision.vision_end_token_id,
            "tie_word_embeddings": args.tie_embeddings,
        }
        return self._with_identity(config, torch_dtype)


def _vision_args(config: Mapping[str, Any], out_dim: int) -> VisionArgs:
    vision = {**_VISION_DEFAULTS, **(config.get("vision_config") or {})}
    if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ConfigError(
            f"Gemma 3 vision_config model_type {vision['model_type']!r} is not supported "
            "(only siglip_vision_model)"
        )
    if vision["vision_use_head"]:
        raise ConfigError("Gemma 3 vision_config vision_use_head=true is not supported")
    if vision["hidden_act"] not in ACTIVATIONS:
        raise ConfigError(
            f"Gemma 3 vision_config hidden_act {vision['hidden_act']!r} is not supported; "
            f"supported: {sorted(ACTIVATIONS)}"
        )
    image_token = config.get("image_token_index", config.get("image_token_id", 262_144))
    return VisionArgs(
        depth=int(vision["num_hidden_layers"]),
        dim=int(vision["hidden_size"]),
        intermediate_dim=int(vision["intermediate_size"]),
        num_heads=int(vision["num_attention_heads"]),
        out_dim=out_dim,
        patch_size=int(vision["patch_size"]),
        in_channels=int(vision["num_channels"]),
        hidden_act=str(vision["hidden_act"]),
        image_token_id=int(image_token),
        vision_start_token_id=int(config.get("boi_token_index", 255_999)),
        vision_end_token_id=int(config.get("eoi_token_index", 256_000)),
        layout="gemma3",
        image_size=int(vision["image_size"]),
        tokens_per_image=int(config.get("mm_tokens_per_image", 256)),
        norm_eps=float(vision["layer_norm_eps"]),
    )


def gemma3_vl_args_from_hf(config: Mapping[str, Any]) -> ModelArgs:
    """Parse a Gemma 3 multimodal (``Gemma3ForConditionalGeneration``) ``config.json``.

    Args:
        config: the parsed file.

    Returns:
        The model's arguments, ``vision`` set (layout ``gemma3``).

    Raises:
        ConfigError: a vision tower other than SigLIP without a pooling head, or what the
            Gemma 3 text family refuses.
    """
    text = {**_TEXT_DEFAULTS, **(config.get("text_config") or {})}
    # The output layer is the outer model's: its tie_word_embeddings decides (transformers 5).
    text["tie_word_embeddings"] = config.get(
        "tie_word_embeddings", text.get("tie_word_embeddings", True)
    )
    args = gemma3_text_args_from_hf(text)
    return dataclasses.replace(
        args,
        family="gemma3",
        final_logit_softcap=None,  # see the module docstring
        vision=_vision_args(config, args.dim),
    )
