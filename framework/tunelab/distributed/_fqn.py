"""Parameter names as the unwrapped module tree spells them.

Wrapping a module for activation checkpointing (``apply_activation_checkpointing``),
``torch.compile`` or FSDP1 adds a component to every name below it; checkpoints, adapters and
LoRA targets use the names without them (the Hugging Face keys).
"""

# Activation checkpointing's wrapper, torch.compile's OptimizedModule, FSDP1's wrapper.
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
