"""Adapter parameter names: recognising LoRA ``A`` and ``B`` keys."""

from __future__ import annotations

_ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key names a LoRA ``A`` or ``B`` weight."""
    return key.endswith(_ADAPTER_SUFFIXES)
