"""Decoder models: the transformer, per-family builders, HF config parsing and loading."""

from tunelab.models.args import ModelArgs
from tunelab.models.decoder import TransformerBlock, TransformerDecoder
from tunelab.models.families import FAMILIES, adapter_for, args_from_hf
from tunelab.models.gemma import Gemma2StateDictAdapter, Gemma3TextStateDictAdapter
from tunelab.models.gpt_oss import GptOssStateDictAdapter
from tunelab.models.llama import LlamaStateDictAdapter
from tunelab.models.loading import LoadResult, from_hf_config, load_hf_into_model, load_pretrained
from tunelab.models.mistral import MistralStateDictAdapter
from tunelab.models.mixtral import MixtralStateDictAdapter
from tunelab.models.phi3 import Phi3StateDictAdapter
from tunelab.models.qwen2 import Qwen2StateDictAdapter
from tunelab.models.qwen3 import Qwen3StateDictAdapter
from tunelab.models.qwen3_moe import Qwen3MoeStateDictAdapter
from tunelab.models.state_dict_adapter import MoEStateDictAdapter, StateDictAdapter

__all__ = [
    "FAMILIES",
    "Gemma2StateDictAdapter",
    "Gemma3TextStateDictAdapter",
    "GptOssStateDictAdapter",
    "LlamaStateDictAdapter",
    "LoadResult",
    "MistralStateDictAdapter",
    "MixtralStateDictAdapter",
    "MoEStateDictAdapter",
    "ModelArgs",
    "Phi3StateDictAdapter",
    "Qwen2StateDictAdapter",
    "Qwen3MoeStateDictAdapter",
    "Qwen3StateDictAdapter",
    "StateDictAdapter",
    "TransformerBlock",
    "TransformerDecoder",
    "adapter_for",
    "args_from_hf",
    "from_hf_config",
    "load_hf_into_model",
    "load_pretrained",
]
