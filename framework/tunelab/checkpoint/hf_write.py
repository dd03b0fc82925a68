"""Hugging Face safetensors checkpoints: the atomic rank-0 writer and model-file copies.

This is the simple, single-process writer (full tensors in memory, one file at a time); a
distributed export of sharded state goes through ``consolidate.HFSafetensorsWriter``.
"""

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from tunelab._fs import fsync_path
from tunelab.checkpoint.hf import MODEL_FILE_PATTERNS, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from tunelab.checkpoint.integrity import FileRecord, copy_file, write_bytes
from tunelab.errors import CheckpointError

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: int | str) -> int:
    """Bytes in ``"5GB"`` (decimal, as HF counts), ``"2GiB"`` (binary) or an int.

    Raises:
        CheckpointError: the string is not a size.
    """
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise CheckpointError(f"max_shard_size {size!r} is not a size like '5GB' or 1000000")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def _plan_files(
    state_dict: Mapping[str, torch.Tensor], max_bytes: int, fqn_to_file: Mapping[str, str] | None
) -> dict[str, list[str]]:
    if fqn_to_file is not None:
        plan: dict[str, list[str]] = {}
        for key in state_dict:
            if key not in fqn_to_file:
                raise CheckpointError(f"fqn_to_file has no file for {key!r}")
            plan.setdefault(fqn_to_file[key], []).append(key)
        return dict(sorted(plan.items()))
    # Greedy in key order, as huggingface_hub splits: a new file when the next tensor would
    # overflow this one; a tensor larger than the limit gets a file to itself.
    groups: list[list[str]] = [[]]
    used = 0
    for key, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        if groups[-1] and used + size > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += size
    if len(groups) == 1:
        return {SAFE_WEIGHTS_NAME: groups[0]}
    total = len(groups)
    return {f"model-{i + 1:05d}-of-{total:05d}.safetensors": keys for i, keys in enumerate(groups)}


def _to_cpu(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> dict:
    out, storages = {}, set()
    for key, tensor in tensors:
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.to("cpu").contiguous()
        # safetensors refuses aliased tensors in one file; tied copies become real copies.
        storage = tensor.untyped_storage().data_ptr()
        out[key] = tensor.clone() if storage in storages else tensor
        storages.add(storage)
    return out


def _write_config(config: Mapping, path: Path, torch_dtype: torch.dtype | None) -> FileRecord:
    config = dict(config)
    if torch_dtype is not None:
        # transformers 4 reads `torch_dtype`, transformers 5 `dtype`: write both.
        config["torch_dtype"] = config["dtype"] = str(torch_dtype).removeprefix("torch.")
    return write_bytes(path, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def copy_model_files(
    source_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    torch_dtype: torch.dtype | None = None,
) -> dict[str, FileRecord]:
    """Copy config, tokenizer and generation files (``MODEL_FILE_PATTERNS``) to ``output_dir``.

    Weights and adapter files are never copied: a folder with ``adapter_config.json`` next to
    merged weights would make transformers apply the adapter twice.

    Args:
        source_dir: the checkpoint the weights came from.
        output_dir: an existing directory.
        torch_dtype: if given, ``config.json`` records it as ``torch_dtype`` and ``dtype``.

    Returns:
        Each copied file's name and checksum record (taken as it is written, fsynced).

    Raises:
        CheckpointError: ``source_dir`` does not exist or its ``config.json`` is not JSON.
    """
    source, output = Path(source_dir), Path(output_dir)
    if not source.is_dir():
        raise CheckpointError(f"source directory {source} does not exist")
    copied: dict[str, FileRecord] = {}
    for pattern in MODEL_FILE_PATTERNS:
        for path in sorted(source.glob(pattern)):
            if not path.is_file() or path.name in copied:
                continue
            if path.name == "config.json":
                try:
                    config = json.loads(path.read_text())
                except ValueError:
                    raise CheckpointError(f"{path}: not valid JSON") from None
                copied[path.name] = _write_config(config, output / path.name, torch_dtype)
            else:
                copied[path.name] = copy_file(path, output / path.name)
    return copied


def save_hf_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    output_dir: str | os.PathLike,
    *,
    source_dir: str | os.PathLike | None = None,
    torch_dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    fqn_to_file: Mapping[str, str] | None = None,
    config: Mapping | None = None,
) -> Path:
    """Write an HF checkpoint directory from full tensors (one process).

    Everything is written into a temporary sibling directory and renamed into place once
    complete (and fsynced), so a failure never leaves a partial output, and an existing
    ``output_dir`` is replaced only by a complete new one.

    Args:
        state_dict: HF keys to full (not sharded) tensors, e.g.
            ``model.state_dict_adapter.to_hf(model.state_dict())``.
        output_dir: the directory to create or replace.
        source_dir: copy config/tokenizer/generation files from here (``copy_model_files``).
        torch_dtype: cast floating tensors to this dtype; recorded in ``config.json``.
            None keeps each tensor's dtype.
        max_shard_size: bytes per file, an int or a string like ``"5GB"``.
        fqn_to_file: key -> file name to reuse a layout (``HFCheckpointReader.fqn_to_file``);
            overrides ``max_shard_size``.
        config: a ``config.json`` dict to write (wins over the one in ``source_dir``).

    Returns:
        ``output_dir`` as a Path.

    Raises:
        CheckpointError: a value is not a full tensor, a key has no file, or a source file
            is missing.
    """
    from torch.distributed.tensor import DTensor

    for key, tensor in state_dict.items():
        if isinstance(tensor, DTensor) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"{key!r}: save_hf_checkpoint needs full tensors, got {type(tensor).__name__}"
            )
    output = Path(output_dir)
    if output.exists() and not output.is_dir():
        raise CheckpointError(f"{output} exists and is not a directory")
    output.parent.mkdir(parents=True, exist_ok=True)
    plan = _plan_files(state_dict, parse_size(max_shard_size), fqn_to_file)
    temp = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    temp.mkdir()
    try:
        total_size, weight_map = 0, {}
        for filename, keys in plan.items():
            tensors = _to_cpu(((key, state_dict[key]) for key in keys), torch_dtype)
            save_file(tensors, temp / filename, metadata={"format": "pt"})
            fsync_path(temp / filename)
            total_size += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(dict.fromkeys(keys, filename))
            del tensors  # one file's worth of converted tensors at a time
        if list(plan) != [SAFE_WEIGHTS_NAME]:
            index = {
                "metadata": {"total_size": total_size},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (temp / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        floating = [t.dtype for t in state_dict.values() if t.is_floating_point()]
        config_dtype = torch_dtype or (floating[0] if floating else None)
        if source_dir is not None:
            copy_model_files(source_dir, temp, config_dtype)
        if config is not None:
            _write_config(config, temp / "config.json", config_dtype)
        _replace_directory(temp, output)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return output


def _replace_directory(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; an old ``target`` is moved aside first, then deleted."""
    if not target.exists():
        os.rename(new, target)
        return
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
