"""What an HF export writes besides the weights: config, tokenizer and generation files.

The weights are written by ``hf_sharded.save_hf_sharded`` (through
``consolidate.HFSafetensorsWriter``), from one process or many.
"""

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from tunelab._model_files import read_model_text
from tunelab.errors import CheckpointError
from tunelab.formats.hf import MODEL_FILE_PATTERNS, hf_dtype_name
from tunelab.formats.integrity import FileRecord, copy_file, write_bytes

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


def _write_config(config: Mapping, path: Path, torch_dtype: torch.dtype | None) -> FileRecord:
    return write_bytes(path, config_bytes(config, torch_dtype))


def config_bytes(config: Mapping, torch_dtype: torch.dtype | None) -> bytes:
    """The ``config.json`` an export writes for a base model's ``config``.

    Args:
        config: The base model's config (with any changes the export makes).
        torch_dtype: The exported weights' dtype, recorded for transformers 4 and 5.

    Returns:
        The file's bytes: sorted, indented JSON, without a ``quantization_config``.
    """
    config = dict(config)
    # Exported weights are never quantized (a gpt-oss base's MXFP4 experts are written
    # dequantized): a copied quantization_config would have transformers expect packed ones.
    config.pop("quantization_config", None)
    if torch_dtype is not None:
        # transformers 4 reads `torch_dtype`, transformers 5 `dtype`: write both.
        config["torch_dtype"] = config["dtype"] = hf_dtype_name(torch_dtype)
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def copy_model_files(
    source_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    torch_dtype: torch.dtype | None = None,
    extra_files: Mapping[str, bytes] | None = None,
) -> dict[str, FileRecord]:
    """Copy config, tokenizer and generation files (``MODEL_FILE_PATTERNS``) to ``output_dir``.

    Weights and adapter files are never copied: a folder with ``adapter_config.json`` next to
    merged weights would make transformers apply the adapter twice.

    Args:
        source_dir: the checkpoint the weights came from.
        output_dir: an existing directory.
        torch_dtype: if given, ``config.json`` records it as ``torch_dtype`` and ``dtype``.

        extra_files: Files to write after the copies, by name (they win over a copied file of
            the same name), e.g. ``chat_template.jinja`` for a run whose chat template was
            overridden (``Tokenizer.extra_files``).

    Returns:
        Each copied or written file's name and checksum record (taken as it is written).

    Raises:
        CheckpointError: ``source_dir`` does not exist, its ``config.json`` is not JSON, or a
            file to copy is a link out of it or not a regular file.
    """
    source, output = Path(source_dir), Path(output_dir)
    if not source.is_dir():
        raise CheckpointError(f"source directory {source} does not exist")
    copied: dict[str, FileRecord] = {}
    for pattern in MODEL_FILE_PATTERNS:
        for path in sorted(source.glob(pattern)):
            if path.name in copied or (path.is_dir() and not path.is_symlink()):
                continue
            if path.name == "config.json":
                try:
                    config = json.loads(read_model_text(path, source))
                except ValueError:
                    raise CheckpointError(f"{path}: not valid JSON") from None
                copied[path.name] = _write_config(config, output / path.name, torch_dtype)
            else:
                # By content, through the checked open: a link out of the model folder (to
                # /proc/self/environ, say) is an error naming it, never part of an export.
                copied[path.name] = copy_file(path, output / path.name, source_folder=source)
    for name, data in (extra_files or {}).items():
        copied[name] = write_bytes(output / name, data)
    return copied
