"""Which family a Hugging Face checkpoint belongs to, and reading its ``config.json``."""

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab._model_files import read_model_text
from tunelab.errors import CheckpointError, ConfigError
from tunelab.models.args import ModelArgs
from tunelab.models.gemma import (
    Gemma2StateDictAdapter,
    Gemma3TextStateDictAdapter,
    gemma2_args_from_hf,
    gemma3_text_args_from_hf,
)
from tunelab.models.gemma3_vl import Gemma3VLStateDictAdapter, gemma3_vl_args_from_hf
from tunelab.models.gpt_oss import GptOssStateDictAdapter, gpt_oss_args_from_hf
from tunelab.models.llama import LlamaStateDictAdapter, llama_args_from_hf
from tunelab.models.mistral import MistralStateDictAdapter, mistral_args_from_hf
from tunelab.models.mixtral import MixtralStateDictAdapter, mixtral_args_from_hf
from tunelab.models.phi3 import Phi3StateDictAdapter, phi3_args_from_hf
from tunelab.models.qwen2 import Qwen2StateDictAdapter, qwen2_args_from_hf
from tunelab.models.qwen2_5_vl import Qwen2_5_VLStateDictAdapter, qwen2_5_vl_args_from_hf
from tunelab.models.qwen3 import Qwen3StateDictAdapter, qwen3_args_from_hf
from tunelab.models.qwen3_moe import Qwen3MoeStateDictAdapter, qwen3_moe_args_from_hf
from tunelab.models.qwen3_vl import Qwen3VLStateDictAdapter, qwen3_vl_args_from_hf
from tunelab.models.state_dict_adapter import StateDictAdapter


@dataclass(frozen=True)
class Family:
    """How to read one family's ``config.json`` and map its keys."""

    args_from_hf: Callable[[Mapping[str, Any]], ModelArgs]
    adapter: type[StateDictAdapter]


FAMILIES: dict[str, Family] = {
    "llama": Family(llama_args_from_hf, LlamaStateDictAdapter),
    "qwen2": Family(qwen2_args_from_hf, Qwen2StateDictAdapter),
    "qwen3": Family(qwen3_args_from_hf, Qwen3StateDictAdapter),
    "mistral": Family(mistral_args_from_hf, MistralStateDictAdapter),
    "gemma2": Family(gemma2_args_from_hf, Gemma2StateDictAdapter),
    "gemma3_text": Family(gemma3_text_args_from_hf, Gemma3TextStateDictAdapter),
    "phi3": Family(phi3_args_from_hf, Phi3StateDictAdapter),
    "qwen3_moe": Family(qwen3_moe_args_from_hf, Qwen3MoeStateDictAdapter),
    "mixtral": Family(mixtral_args_from_hf, MixtralStateDictAdapter),
    "gpt_oss": Family(gpt_oss_args_from_hf, GptOssStateDictAdapter),
    "qwen2_5_vl": Family(qwen2_5_vl_args_from_hf, Qwen2_5_VLStateDictAdapter),
    "qwen3_vl": Family(qwen3_vl_args_from_hf, Qwen3VLStateDictAdapter),
    "gemma3": Family(gemma3_vl_args_from_hf, Gemma3VLStateDictAdapter),
}
_ARCHITECTURES = {family.adapter.architecture: name for name, family in FAMILIES.items()}


def adapter_for(args: ModelArgs) -> StateDictAdapter:
    """The ``StateDictAdapter`` of ``args.family``.

    Raises:
        ConfigError: unknown family.
    """
    if args.family not in FAMILIES:
        raise ConfigError(f"unknown model family {args.family!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[args.family].adapter(args)


def read_hf_config(checkpoint_dir_or_config: str | os.PathLike | Mapping[str, Any]) -> dict:
    """Return a checkpoint's ``config.json`` as a dict (a dict passes through).

    Raises:
        CheckpointError: the file is missing or not JSON.
    """
    if isinstance(checkpoint_dir_or_config, Mapping):
        return dict(checkpoint_dir_or_config)
    path = Path(checkpoint_dir_or_config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a Hugging Face checkpoint needs config.json")
    try:
        config = json.loads(read_model_text(path))
    except ValueError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def family_of(config: Mapping[str, Any]) -> str:
    """The family named by ``model_type``, else by ``architectures``.

    Raises:
        ConfigError: neither names a supported family.
    """
    model_type = config.get("model_type")
    if model_type in FAMILIES:
        return model_type
    for architecture in config.get("architectures") or []:
        if architecture in _ARCHITECTURES:
            return _ARCHITECTURES[architecture]
    raise ConfigError(
        f"unsupported model: model_type={model_type!r}, architectures="
        f"{config.get('architectures')}; supported model_type values: {sorted(FAMILIES)}"
    )


def args_from_hf(checkpoint_dir_or_config: str | os.PathLike | Mapping[str, Any]) -> ModelArgs:
    """Parse ``ModelArgs`` from a checkpoint directory, a ``config.json`` path or a dict."""
    config = read_hf_config(checkpoint_dir_or_config)
    return FAMILIES[family_of(config)].args_from_hf(config)
