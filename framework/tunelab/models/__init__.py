"""Decoder models: the transformer, per-family builders, HF config parsing and loading."""

from tunelab.models.args import ModelArgs
from tunelab.models.decoder import TransformerBlock, TransformerDecoder
from tunelab.models.families import FAMILIES, adapter_for, args_from_hf, from_hf_config
from tunelab.models.llama import (
    LlamaStateDictAdapter,
    llama2_7b,
    llama3_1_8b,
    llama3_1_70b,
    llama3_2_1b,
    llama3_2_3b,
    llama3_8b,
)
from tunelab.models.loading import LoadResult, load_hf_into_model, load_pretrained
from tunelab.models.qwen2 import Qwen2StateDictAdapter, qwen2_5_0_5b, qwen2_5_1_5b, qwen2_5_7b
from tunelab.models.state_dict_adapter import StateDictAdapter

__all__ = [
    "FAMILIES",
    "LlamaStateDictAdapter",
    "LoadResult",
    "ModelArgs",
    "Qwen2StateDictAdapter",
    "StateDictAdapter",
    "TransformerBlock",
    "TransformerDecoder",
    "adapter_for",
    "args_from_hf",
    "from_hf_config",
    "llama2_7b",
    "llama3_1_70b",
    "llama3_1_8b",
    "llama3_2_1b",
    "llama3_2_3b",
    "llama3_8b",
    "load_hf_into_model",
    "load_pretrained",
    "qwen2_5_0_5b",
    "qwen2_5_1_5b",
    "qwen2_5_7b",
]
