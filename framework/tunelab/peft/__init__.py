"""LoRA as one generic module swap: adapter state in PEFT names, and a shard-local merge."""

from tunelab.config.lora import LoRAArgs, read_adapter_config
from tunelab.peft.apply import (
    apply_lora,
    disable_adapter,
    get_adapter_params,
    init_lora_parameters,
    lora_target_names,
    set_trainable_params,
)
from tunelab.peft.expert_lora import ExpertLoRA
from tunelab.peft.inference_merge import merged_adapters
from tunelab.peft.lora import LoRALinear
from tunelab.peft.merge import merged_state_dict
from tunelab.peft.peft_io import load_peft_adapter, save_peft_adapter
from tunelab.peft.state import adapter_state_dict

__all__ = [
    "ExpertLoRA",
    "LoRAArgs",
    "LoRALinear",
    "adapter_state_dict",
    "apply_lora",
    "disable_adapter",
    "get_adapter_params",
    "init_lora_parameters",
    "load_peft_adapter",
    "lora_target_names",
    "merged_adapters",
    "merged_state_dict",
    "read_adapter_config",
    "save_peft_adapter",
    "set_trainable_params",
]
