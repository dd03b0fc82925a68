"""Read and write LoRA adapters in PEFT's folder format.

A PEFT adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors``
(PEFT key names, ``{"format": "pt"}`` metadata). It must never share a folder with merged
weights: with peft installed, transformers 5 loads such a folder's weights and then applies
the adapter on top (W + 2ΔW), silently.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tunelab._fs import fsync_path
from tunelab._model_files import model_file
from tunelab.config.lora import ADAPTER_CONFIG_NAME, LoRAArgs, read_adapter_config
from tunelab.errors import CheckpointError
from tunelab.formats.integrity import write_bytes
from tunelab.formats.layout import temporary_name, write_manifest
from tunelab.peft.apply import lora_modules
from tunelab.peft.state import (
    adapter_state_dict,
    from_peft_state_dict,
    to_peft_state_dict,
)

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
# Files that mean "a full model lives here"; an adapter must not be written beside them.
_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")


def save_peft_adapter(
    state_dict: Mapping[str, torch.Tensor], config: Mapping, output_dir: str | os.PathLike
) -> Path:
    """Write a PEFT adapter folder atomically.

    The files are written and fsynced in a temporary sibling folder which then replaces
    ``output_dir`` by rename, so a crash leaves either the old adapter or the new one,
    never a mix. Call it on one rank, with full tensors.

    Args:
        state_dict: Adapter weights under native keys, full (not sharded) tensors, e.g.
            ``{k: v.full_tensor() for k, v in adapter_state_dict(model).items()}``.
        config: The ``adapter_config.json`` content (``LoRAArgs.peft_config``).
        output_dir: The adapter folder; replaced as a whole if it exists.

    Returns:
        ``output_dir`` as a ``Path``.

    Raises:
        CheckpointError: If a tensor is still sharded, or ``output_dir`` holds model files
            (an adapter must not sit beside merged weights).
    """
    output_dir = Path(output_dir)
    sharded = [key for key, value in state_dict.items() if isinstance(value, DTensor)]
    if sharded:
        raise CheckpointError(
            f"save_peft_adapter needs full tensors, but {sharded[0]!r} is a DTensor; "
            "gather with .full_tensor() on every rank first"
        )
    present = [name for name in _MODEL_FILES if (output_dir / name).exists()]
    if present:
        raise CheckpointError(
            f"refusing to write a LoRA adapter into {output_dir}: it holds model files "
            f"({', '.join(present)}); an adapter beside merged weights is applied twice by transformers"
        )
    peft_state = to_peft_state_dict(state_dict, config.get("modules_to_save") or ())
    tensors = {k: v.detach().contiguous().cpu() for k, v in peft_state.items()}
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    # Temporary names of tunelab's pattern (a run removes them at start if a crash left
    # them), made with plain mkdir so modes follow the umask like every other output.
    staging = output_dir.parent / temporary_name(output_dir.name, "tmp", os.getpid())
    retired = output_dir.parent / temporary_name(output_dir.name, "old", os.getpid())
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        # Serialised in memory (an adapter is small) so the checksums come from the bytes
        # as they are written.
        weights = save(tensors, metadata={"format": "pt"})
        config_text = (json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode()
        files = {
            ADAPTER_WEIGHTS_NAME: write_bytes(staging / ADAPTER_WEIGHTS_NAME, weights),
            ADAPTER_CONFIG_NAME: write_bytes(staging / ADAPTER_CONFIG_NAME, config_text),
        }
        write_manifest(staging, files, kind="adapter")
        if output_dir.exists():
            # A directory cannot be renamed over a non-empty one: move the old adapter aside
            # first, so the folder is always either the complete old or the complete new one.
            shutil.rmtree(retired, ignore_errors=True)
            os.rename(output_dir, retired)
            os.rename(staging, output_dir)
            shutil.rmtree(retired)
        else:
            os.rename(staging, output_dir)
        fsync_path(output_dir.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir


@torch.no_grad()
def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    full = full.to(dtype=param.dtype)
    if isinstance(param, DTensor):
        # Every rank read the whole (small) file; each keeps its own shard, no communication.
        shard = distribute_tensor(
            full.to(param.to_local().device),
            param.device_mesh,
            param.placements,
            src_data_rank=None,
        )
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def load_peft_adapter(model: nn.Module, adapter_dir: str | os.PathLike) -> None:
    """Load a PEFT LoRA adapter into a model that already has matching LoRA layers.

    Works on plain and FSDP2-sharded models (every rank reads the file and keeps its shard).
    Only safetensors adapters are read, never pickles.

    Args:
        model: A LoRA-applied model (``apply_lora`` with the adapter's settings).
        adapter_dir: The PEFT adapter folder.

    Raises:
        CheckpointError: If a file is missing or unreadable, the keys differ from the
            model's adapter keys, a shape differs, or ``r``/``lora_alpha``/``use_rslora``/
            ``use_dora`` differ from the model's LoRA layers.
    """
    adapter_dir = Path(adapter_dir)
    config = read_adapter_config(adapter_dir)
    expected = LoRAArgs.from_peft_config(config)
    want = (expected.rank, expected.alpha, expected.use_rslora, expected.use_dora)
    for name, module in lora_modules(model).items():
        got = (module.rank, module.alpha, module.use_rslora, module.use_dora)
        if got != want:
            raise CheckpointError(
                f"adapter {adapter_dir} has (r, lora_alpha, use_rslora, use_dora)={want}, "
                f"but the model's LoRA layer {name} has {got}"
            )
    weights_path = adapter_dir / ADAPTER_WEIGHTS_NAME
    if not weights_path.is_file():
        raise CheckpointError(
            f"no {ADAPTER_WEIGHTS_NAME} in adapter folder {adapter_dir} (only safetensors is read)"
        )
    try:
        # The checked path: a link out of the adapter folder is refused, never read.
        stored = load_file(model_file(weights_path, adapter_dir))
    except SafetensorError as error:
        raise CheckpointError(f"cannot read {weights_path}: {error}") from error
    targets = adapter_state_dict(model)
    # PEFT names weights by transformers' modules (``peft_module_path``; a vision-language
    # model's differ from its native names).
    path_of = getattr(model, "peft_module_path", lambda key: key)  # plain modules: the same
    native_of = {path_of(key): key for key in targets}
    loaded = from_peft_state_dict(stored, native_of)
    loaded = {native_of.get(key, key): value for key, value in loaded.items()}
    missing = sorted(set(targets) - set(loaded))
    unexpected = sorted(set(loaded) - set(targets))
    if missing or unexpected:
        raise CheckpointError(
            f"adapter {weights_path} does not match the model's LoRA layers: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    for key, target in targets.items():
        if tuple(loaded[key].shape) != tuple(target.shape):
            raise CheckpointError(
                f"adapter {weights_path}: {key} has shape {tuple(loaded[key].shape)}, "
                f"the model expects {tuple(target.shape)}"
            )
    for key, target in targets.items():
        # state_dict values are detached aliases of the (sharded) parameters: copying into
        # them writes the live parameters.
        _copy_full_into(target, loaded[key])
