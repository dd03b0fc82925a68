"""Parameter names: unwrapping wrapper components, recognising adapter keys."""

from __future__ import annotations

_ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
# Wrappers that add a name component without changing the module tree: activation
# checkpointing's wrapper, torch.compile's OptimizedModule, FSDP1.
_WRAPPER_COMPONENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_fqn(fqn: str) -> str:
    """Drop wrapper name components (checkpoint wrapper, ``torch.compile``) from an FQN.

    Args:
        fqn: A parameter or module name as ``named_parameters`` / ``state_dict`` give it.

    Returns:
        The name in the unwrapped module tree, i.e. the Hugging Face key.
    """
    for component in _WRAPPER_COMPONENTS:
        fqn = fqn.replace(component, "")
    return fqn


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key names a LoRA ``A`` or ``B`` weight."""
    return key.endswith(_ADAPTER_SUFFIXES)
