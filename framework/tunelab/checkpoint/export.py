"""Hugging Face exports for inference: ``epoch_{E}/`` (and ``epoch_{E}/adapter/`` for LoRA).

For LoRA the small PEFT adapter is written first, into its own folder: with peft installed,
transformers treats a folder holding ``adapter_config.json`` as an adapter and would apply it
again on top of merged weights. Then the merged model: each rank merges its own rows of
``W + scale * B @ A`` into new tensors (live weights are never touched; FSDP2's state dict
aliases them) and every rank writes its rows straight into the final safetensors files
through DCP, whose finish step writes the headers and the index. No rank gathers the model.
Each merge runs inside the writer just before its rows are written, so one merged weight
exists at a time and one rank's merge overlaps the other ranks' writes.

Both go into a new folder that replaces ``epoch_{E}/`` as a whole at the end (one atomic
exchange where the system can): a crash at any moment leaves the old export or the new one,
each verifying, never a new adapter beside old weights.
"""

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

import tunelab.peft as peft
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.checkpoint.hf_write import config_bytes
from tunelab.config.lora import LoRAArgs
from tunelab.distributed import gather_full_tensors
from tunelab.distributed._fqn import clean_fqn
from tunelab.formats.hf import HFCheckpointReader
from tunelab.models.families import read_hf_config
from tunelab.peft.apply import peft_target_modules
from tunelab.peft.merge import lazy_merged_state_dict

ADAPTER_DIR_NAME = "adapter"
"""A LoRA export's PEFT adapter folder, inside the export (never beside merged weights)."""


def export_hf(
    model: nn.Module,
    output_dir: str | os.PathLike,
    *,
    base_checkpoint_dir: str | os.PathLike,
    lora: LoRAArgs | None = None,
    process_group: dist.ProcessGroup | None = None,
    extra_files: Mapping[str, bytes] | None = None,
) -> Path:
    """Export a (possibly sharded) model in Hugging Face format.

    Args:
        model: The model, sharded with FSDP2 or not.
        output_dir: The export folder, ``epoch_{E}``.
        base_checkpoint_dir: The base model's folder: its file names, config and tokenizer
            files are carried over.
        lora: The LoRA settings when the model carries adapters; the adapter goes to
            ``output_dir/adapter`` and the merged weights to ``output_dir``.
        process_group: Group for the collective write (default group when None).
        extra_files: Files written beside the copied tokenizer files, by name (e.g. the
            ``chat_template.jinja`` of an overridden template; ``Tokenizer.extra_files``).

    Returns:
        The export folder.
    """
    output_dir = Path(output_dir)
    base_checkpoint_dir = Path(base_checkpoint_dir)
    write_adapter = None
    if lora is not None:
        # One collective for the whole (small) adapter; the merge reuses its gathered A's.
        adapter = gather_full_tensors(peft.adapter_state_dict(model))
        config = lora.peft_config(peft.lora_target_names(model), str(base_checkpoint_dir))
        config["target_modules"] = peft_target_modules(model)
        config["task_type"] = model.peft_task_type
        whole = model.peft_modules_to_save()
        if whole:
            # Whole trained modules (a reward model's score head, a vision tower trained in
            # full) travel in the adapter, as PEFT's modules_to_save:
            # base_model.model.score.weight.
            config["modules_to_save"] = whole
            adapter |= gather_full_tensors(_module_weights(model, whole))

        def write_adapter(new_export: Path) -> None:
            # Into the new export's folder, first: the two are replaced together, whole.
            # Under the module names of transformers' model (a vision-language model's differ
            # from its checkpoint keys).
            named = {model.peft_module_path(key): value for key, value in adapter.items()}
            peft.save_peft_adapter(named, config, new_export / ADAPTER_DIR_NAME)

        # The merges run inside the writer, one weight at a time, as each is written.
        state_dict, merges = lazy_merged_state_dict(model, full_adapter=adapter)
    else:
        state_dict, merges = dict(model.state_dict()), {}
    hf_state_dict = model.state_dict_adapter.to_hf(state_dict)
    dtype = next(iter(hf_state_dict.values())).dtype
    updates = model.hf_config_updates()
    if updates:
        # A model that is not the base's causal LM (a sequence classifier) says so in its
        # config.json, which replaces the copied one.
        base_config = read_hf_config(base_checkpoint_dir)
        extra_files = {
            **(extra_files or {}),
            "config.json": config_bytes(base_config | updates, dtype),
        }
    save_hf_sharded(
        hf_state_dict,
        output_dir,
        fqn_to_file=_base_file_layout(model, base_checkpoint_dir, hf_state_dict),
        process_group=process_group,
        source_dir=base_checkpoint_dir,
        torch_dtype=dtype,
        local_transforms={model.state_dict_adapter.to_hf_key(k): f for k, f in merges.items()},
        extra_files=extra_files,
        first=write_adapter,
    )
    return output_dir


def _module_weights(model: nn.Module, modules: list[str]) -> dict[str, Any]:
    """The parameters of whole modules (by their native paths) by FQN, sharded as they are."""
    prefixes = tuple(f"{module}." for module in modules)
    return {
        clean_fqn(key): value
        for key, value in model.state_dict().items()
        if clean_fqn(key).startswith(prefixes)
    }


def _base_file_layout(
    model: nn.Module, base_checkpoint_dir: Path, hf_state_dict: Mapping[str, object]
) -> dict[str, str] | None:
    """The base's key-to-file map, or None (a fresh layout) for a quantized base.

    A base whose expert weights are MXFP4 (gpt-oss) names files for their blocks and scales,
    not for the dequantized tensors the export writes, which are about four times larger.
    """
    files = HFCheckpointReader(base_checkpoint_dir).fqn_to_file
    adapter = model.state_dict_adapter
    absent = [key for key in hf_state_dict if key not in files]
    if absent and all(
        (forms := adapter.mxfp4_hf_keys(key)) is not None and forms[0] in files for key in absent
    ):
        return None
    # A head the base does not have (a reward model's score) goes into the last file.
    last = max(files.values())
    return {**files, **{key: last for key in absent}}
