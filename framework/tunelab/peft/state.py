"""Adapter state in native and PEFT key names (``adapter_config.json`` is ``LoRAArgs``' business).

Native keys are the module FQNs (``model.layers.0.self_attn.q_proj.lora_A.weight``); PEFT
prefixes them with ``base_model.model.``. Because the native module tree mirrors Hugging
Face names, that prefix is the whole mapping for linear layers.

Stacked expert weights (``ExpertLoRA``, native ``<experts>.lora.<projection>.lora_A.weight``)
are PEFT ``target_parameters``: PEFT wraps the experts module once per adapted parameter, in
the module's parameter order, so the first wrapper ends up innermost. With both projections
adapted ``gate_up_proj``'s factors are ``<experts>.base_layer.lora_A.weight`` and
``down_proj``'s ``<experts>.lora_A.weight``; with one, its factors are ``<experts>.lora_A.weight``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from tunelab.distributed._fqn import clean_fqn
from tunelab.errors import CheckpointError, TunelabError
from tunelab.peft._names import adapter_owner, is_adapter_key
from tunelab.peft.apply import lora_modules
from tunelab.peft.expert_lora import EXPERT_PROJECTIONS

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module FQN in ``adapter_model.safetensors``."""


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


def peft_key_names(native_keys: Iterable[str]) -> dict[str, str]:
    """PEFT's key for each native adapter key (see the module docstring).

    Args:
        native_keys: Adapter keys under native names, all of one adapter (the expert keys'
            PEFT names depend on which projections of the same experts are adapted).

    Returns:
        ``{native_key: peft_key}``.
    """
    native_keys = list(native_keys)
    owners = {adapter_owner(key) for key in native_keys}
    names = {}
    for key in native_keys:
        owner = adapter_owner(key)
        experts, _, projection = owner.rpartition(".lora.")
        if not experts or projection not in EXPERT_PROJECTIONS:
            names[key] = PEFT_PREFIX + key
            continue
        # Parameter order gate_up_proj, down_proj: the later one wraps the earlier one.
        later = EXPERT_PROJECTIONS[EXPERT_PROJECTIONS.index(projection) + 1 :]
        wrapped = any(f"{experts}.lora.{other}" in owners for other in later)
        peft_owner = f"{experts}.base_layer" if wrapped else experts
        names[key] = PEFT_PREFIX + peft_owner + key.removeprefix(owner)
    return names


def to_peft_state_dict(
    state_dict: Mapping[str, torch.Tensor], modules_to_save: Iterable[str] = ()
) -> dict[str, torch.Tensor]:
    """Rename native adapter keys to PEFT's (``peft_key_names``).

    ``X.lora_A.weight`` -> ``base_model.model.X.lora_A.weight``; expert factors as the module
    docstring says. A whole module of ``modules_to_save`` (``score.weight``; a module whose
    path ends with the name, as PEFT matches them) is saved as PEFT saves it,
    ``base_model.model.score.weight``.

    Args:
        state_dict: Adapter weights under native keys.
        modules_to_save: Modules whose whole weights the adapter carries, by the end of their
            paths.

    Returns:
        The same tensors under PEFT keys.

    Raises:
        TunelabError: If a key is neither a LoRA ``A``/``B`` weight nor in ``modules_to_save``.
    """
    # PEFT matches modules_to_save by the end of a module's path: `visual.blocks.0` names
    # transformers' `model.visual.blocks.0`, and every weight under it.
    saved = [f".{module}." for module in modules_to_save]
    whole = {key for key in state_dict if any(module in f".{key}" for module in saved)}
    for key in state_dict:
        if key not in whole and not is_adapter_key(key):
            raise TunelabError(f"to_peft_state_dict: {key!r} is not a LoRA adapter weight")
    names = peft_key_names(key for key in state_dict if key not in whole)
    names |= {key: PEFT_PREFIX + key for key in whole}
    return {names[key]: value for key, value in state_dict.items()}


def from_peft_state_dict(
    state_dict: Mapping[str, torch.Tensor], native_keys: Iterable[str] = ()
) -> dict[str, torch.Tensor]:
    """Rename PEFT adapter keys back to native FQNs (the inverse of ``to_peft_state_dict``).

    Args:
        state_dict: Adapter weights under PEFT keys.
        native_keys: The native adapter keys of the model the adapter is for; needed to name
            expert factors back (``<experts>.lora_A.weight`` may be either projection's).

    Returns:
        The same tensors under native keys.

    Raises:
        CheckpointError: If a key lacks the PEFT prefix or is not a LoRA ``A``/``B`` weight
            (other adapter types and ``modules_to_save`` are not supported).
    """
    native_of = {peft: key for key, peft in peft_key_names(native_keys).items()}
    native = {}
    for key, value in state_dict.items():
        if key in native_of:
            native[native_of[key]] = value
            continue
        if not key.startswith(PEFT_PREFIX) or not is_adapter_key(key):
            raise CheckpointError(
                f"adapter key {key!r} is not a PEFT LoRA weight "
                f"('{PEFT_PREFIX}<module>.lora_A.weight' or '.lora_B.weight')"
            )
        native[key.removeprefix(PEFT_PREFIX)] = value
    return native
