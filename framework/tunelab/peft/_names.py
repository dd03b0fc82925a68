"""Adapter parameter names: recognising LoRA ``A`` and ``B`` keys and DoRA magnitudes."""

from __future__ import annotations

MAGNITUDE = "lora_magnitude_vector"
"""DoRA's magnitude vector, under PEFT's name (a parameter of the adapted module)."""

_ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight", f".{MAGNITUDE}")


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key names a LoRA ``A`` or ``B`` weight or a DoRA magnitude."""
    return key.endswith(_ADAPTER_SUFFIXES)


def adapter_owner(key: str) -> str:
    """The adapted module's FQN of an adapter key (``...q_proj.lora_A.weight`` -> ``...q_proj``)."""
    if key.endswith(f".{MAGNITUDE}"):
        return key.rpartition(".")[0]
    return key.rsplit(".", 2)[0]
