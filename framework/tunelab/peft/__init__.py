"""LoRA as one generic module swap: adapter state in PEFT names, and a shard-local merge."""

from tunelab.peft._names import clean_fqn
from tunelab.peft.apply import (
    ALL_LINEAR,
    LORA_TARGETS,
    apply_lora,
    disable_adapter,
    get_adapter_params,
    init_lora_parameters,
    lora_modules,
    lora_target_names,
    set_trainable_params,
)
from tunelab.peft.lora import LoRALinear, lora_scale
from tunelab.peft.merge import lazy_merged_state_dict, merge_weight, merged_state_dict
from tunelab.peft.peft_io import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    load_peft_adapter,
    read_adapter_config,
    save_peft_adapter,
)
from tunelab.peft.state import (
    PEFT_PREFIX,
    adapter_config,
    adapter_state_dict,
    from_peft_state_dict,
    lora_kwargs_from_config,
    to_peft_state_dict,
)

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "ALL_LINEAR",
    "LORA_TARGETS",
    "PEFT_PREFIX",
    "LoRALinear",
    "adapter_config",
    "adapter_state_dict",
    "apply_lora",
    "clean_fqn",
    "disable_adapter",
    "from_peft_state_dict",
    "get_adapter_params",
    "init_lora_parameters",
    "load_peft_adapter",
    "lora_kwargs_from_config",
    "lora_modules",
    "lora_scale",
    "lora_target_names",
    "merge_weight",
    "lazy_merged_state_dict",
    "merged_state_dict",
    "read_adapter_config",
    "save_peft_adapter",
    "set_trainable_params",
    "to_peft_state_dict",
]
