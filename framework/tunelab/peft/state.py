"""Adapter state in native and PEFT key names, and the PEFT ``adapter_config.json`` content.

Native keys are the module FQNs (``model.layers.0.self_attn.q_proj.lora_A.weight``); PEFT
prefixes them with ``base_model.model.``. Because the native module tree mirrors Hugging
Face names, that prefix is the whole mapping.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from tunelab.distributed._fqn import clean_fqn
from tunelab.errors import CheckpointError, ConfigError, TunelabError
from tunelab.peft._names import adapter_owner, is_adapter_key
from tunelab.peft.apply import ALL_LINEAR, lora_modules

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module FQN in ``adapter_model.safetensors``."""

# PEFT options that change what the adapter computes and that tunelab does not implement.
_UNSUPPORTED_OPTIONS = (
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
    "layers_to_transform",
)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights of ``model`` under native FQN keys.

    Read through ``model.state_dict()`` so that under FSDP2 the values are the sharded
    DTensors (they stay DTensors: gather them yourself, collectively, to save one file).
    The tensors alias the live parameters; do not modify them.

    Args:
        model: A LoRA-applied model, sharded or not.

    Returns:
        ``{"<module>.lora_A.weight": tensor, "<module>.lora_B.weight": tensor, ...}``, plus
        ``"<module>.lora_magnitude_vector"`` for DoRA.

    Raises:
        TunelabError: If the model has no LoRA layers.
    """
    modules = {clean_fqn(name) for name in lora_modules(model)}
    if not modules:
        raise TunelabError(
            "adapter_state_dict: the model has no LoRA layers; call apply_lora first"
        )
    state = {}
    for key, value in model.state_dict().items():
        key = clean_fqn(key)
        if is_adapter_key(key) and adapter_owner(key) in modules:
            state[key] = value
    return state


def to_peft_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename native adapter keys to PEFT's: ``X.lora_A.weight`` -> ``base_model.model.X.lora_A.weight``.

    Args:
        state_dict: Adapter weights under native keys.

    Returns:
        The same tensors under PEFT keys.

    Raises:
        TunelabError: If a key is not a LoRA ``A``/``B`` weight.
    """
    for key in state_dict:
        if not is_adapter_key(key):
            raise TunelabError(f"to_peft_state_dict: {key!r} is not a LoRA adapter weight")
    return {PEFT_PREFIX + key: value for key, value in state_dict.items()}


def from_peft_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename PEFT adapter keys back to native FQNs (the inverse of ``to_peft_state_dict``).

    Args:
        state_dict: Adapter weights under PEFT keys.

    Returns:
        The same tensors under native keys.

    Raises:
        CheckpointError: If a key lacks the PEFT prefix or is not a LoRA ``A``/``B`` weight
            (other adapter types and ``modules_to_save`` are not supported).
    """
    native = {}
    for key, value in state_dict.items():
        if not key.startswith(PEFT_PREFIX) or not is_adapter_key(key):
            raise CheckpointError(
                f"adapter key {key!r} is not a PEFT LoRA weight "
                f"('{PEFT_PREFIX}<module>.lora_A.weight' or '.lora_B.weight')"
            )
        native[key.removeprefix(PEFT_PREFIX)] = value
    return native


def resolve_target_names(targets: Sequence[str]) -> list[str]:
    """Short target names (last FQN components), sorted and unique.

    Args:
        targets: Short names or the FQNs ``apply_lora`` returned.

    Returns:
        E.g. ``["q_proj", "v_proj"]``.

    Raises:
        ConfigError: If ``targets`` is a string (pass the resolved names) or empty.
    """
    if isinstance(targets, str):
        raise ConfigError(
            f"adapter_config targets must be the resolved module names (the list apply_lora "
            f"returns), got the string {targets!r}"
        )
    names = sorted({target.rpartition(".")[2] for target in targets})
    if not names:
        raise ConfigError("adapter_config targets is empty")
    return names


def adapter_config(
    *,
    rank: int,
    alpha: float,
    dropout: float,
    targets: Sequence[str],
    use_rslora: bool,
    base_model_name_or_path: str | None,
    use_dora: bool = False,
) -> dict:
    """The content of a PEFT ``adapter_config.json`` for a tunelab LoRA adapter.

    Complete enough that ``peft.PeftModel.from_pretrained`` builds the same adapter.

    Args:
        rank: Adapter rank ``r``.
        alpha: LoRA ``alpha``.
        dropout: Adapter dropout probability.
        targets: The adapted modules: short names or the FQNs ``apply_lora`` returned.
        use_rslora: Whether the scale is ``alpha / sqrt(r)``.
        base_model_name_or_path: The base model's hub id or folder (may be ``None``).
        use_dora: Whether the adapter is DoRA (has ``lora_magnitude_vector`` weights).

    Returns:
        A JSON-serialisable dict.

    Raises:
        ConfigError: If ``targets`` is a string or empty.
    """
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": resolve_target_names(targets),
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": use_dora,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def lora_kwargs_from_config(config: Mapping) -> dict:
    """``apply_lora`` keyword arguments from a PEFT adapter config.

    Args:
        config: A parsed ``adapter_config.json`` (see ``read_adapter_config``).

    Returns:
        ``{"targets", "rank", "alpha", "dropout", "use_rslora", "use_dora"}``.

    Raises:
        CheckpointError: If the config uses PEFT features tunelab does not implement.
    """
    targets = config["target_modules"]
    if isinstance(targets, str) and targets != ALL_LINEAR:
        raise CheckpointError(
            f"adapter target_modules {targets!r} is a regex; tunelab supports a list of names or 'all-linear'"
        )
    unsupported = {key: config[key] for key in _UNSUPPORTED_OPTIONS if config.get(key)}
    if config.get("bias", "none") != "none":
        unsupported["bias"] = config["bias"]
    if unsupported:
        raise CheckpointError(f"adapter config sets {unsupported}, which tunelab does not support")
    return {
        "targets": targets,
        "rank": config["r"],
        "alpha": config["lora_alpha"],
        "dropout": config.get("lora_dropout", 0.0),
        "use_rslora": bool(config.get("use_rslora", False)),
        "use_dora": bool(config.get("use_dora", False)),
    }
