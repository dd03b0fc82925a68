"""Decoder models: the transformer, per-family builders, HF config parsing and loading."""

from tunelab.models.args import ModelArgs
from tunelab.models.decoder import TransformerBlock, TransformerDecoder
from tunelab.models.families import FAMILIES, adapter_for, args_from_hf
from tunelab.models.llama import LlamaStateDictAdapter
from tunelab.models.loading import LoadResult, from_hf_config, load_hf_into_model, load_pretrained
from tunelab.models.qwen2 import Qwen2StateDictAdapter
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
    "load_hf_into_model",
    "load_pretrained",
]
