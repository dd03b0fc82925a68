"""Hugging Face safetensors checkpoints: a validating reader and an atomic rank-0 writer.

Layout (what ``transformers.save_pretrained`` writes, and what it reads):

* one ``model.safetensors`` when every tensor fits in ``max_shard_size``;
* otherwise ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``
  (``{"metadata": {"total_size": bytes}, "weight_map": {key: file}}``);
* ``{"format": "pt"}`` metadata in every file; ``config.json``, tokenizer and generation files
  alongside.

Only safetensors are read: nothing here unpickles a file.
"""

import json
import os
import re
import shutil
import struct
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tunelab.errors import CheckpointError

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Files copied next to exported weights: config, tokenizer, generation settings, licence.
MODEL_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.tiktoken",
    "LICENSE*",
)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


# ---- reading ------------------------------------------------------------------------------
def read_safetensors_header(path: str | os.PathLike) -> dict[str, dict]:
    """Parse and check a safetensors header without reading tensor data.

    Args:
        path: the file.

    Returns:
        Tensor name -> ``{"dtype", "shape", "data_offsets"}`` (``__metadata__`` removed).

    Raises:
        CheckpointError: the file is missing, truncated, or its header is not valid.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
            if header_len is None or 8 + header_len > size:
                raise CheckpointError(f"{path}: truncated safetensors file (incomplete header)")
            raw = f.read(header_len)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    try:
        header = json.loads(raw)
        assert isinstance(header, dict)
    except (ValueError, AssertionError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)") from None
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    for key, entry in header.items():
        try:
            dtype = _DTYPES[entry["dtype"]]
            begin, end = entry["data_offsets"]
            numel = 1
            for dim in entry["shape"]:
                numel *= int(dim)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {key!r}") from None
        if end - begin != numel * dtype.itemsize:
            raise CheckpointError(f"{path}: corrupt header, {key!r} has the wrong byte size")
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: {key!r} ends at byte {end} of the data "
                f"section but the file holds {data_size} bytes"
            )
    return header


class HFCheckpointReader:
    """Random access to the tensors of an HF checkpoint directory.

    Headers of every file are validated up front, so a corrupt or truncated download fails
    here, naming the file, before any model is built. Data is memory-mapped and read per
    tensor (or per row range) on demand.

    Args:
        checkpoint_dir: a directory with ``model.safetensors`` or
            ``model.safetensors.index.json`` and its shards.

    Raises:
        CheckpointError: the directory, the index or a named file is missing or corrupt.
    """

    def __init__(self, checkpoint_dir: str | os.PathLike) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        if not self.checkpoint_dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.checkpoint_dir} does not exist")
        weight_map = self._read_index()
        files = sorted(set(weight_map.values())) if weight_map else [SAFE_WEIGHTS_NAME]
        self._entries: dict[str, tuple[str, torch.dtype, tuple[int, ...]]] = {}
        for filename in files:
            path = self.checkpoint_dir / filename
            if not path.is_file():
                raise CheckpointError(
                    f"{path} is missing; {SAFE_WEIGHTS_INDEX_NAME} maps tensors to it"
                )
            for key, entry in read_safetensors_header(path).items():
                if key in self._entries:
                    raise CheckpointError(
                        f"{path}: {key!r} also appears in {self._entries[key][0]}"
                    )
                self._entries[key] = (filename, _DTYPES[entry["dtype"]], tuple(entry["shape"]))
        for key, filename in (weight_map or {}).items():
            if self._entries.get(key, (None,))[0] != filename:
                raise CheckpointError(
                    f"{self.checkpoint_dir / SAFE_WEIGHTS_INDEX_NAME} maps {key!r} to "
                    f"{filename}, which does not contain it"
                )
        self._handles: dict[str, object] = {}

    def _read_index(self) -> dict[str, str] | None:
        index = self.checkpoint_dir / SAFE_WEIGHTS_INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (ValueError, KeyError, TypeError, AssertionError):
                raise CheckpointError(f"{index}: corrupt index (no weight_map object)") from None
            return weight_map
        if (self.checkpoint_dir / SAFE_WEIGHTS_NAME).is_file():
            return None
        pickles = sorted(p.name for p in self.checkpoint_dir.glob("*.bin"))
        hint = (
            f" (found {pickles[0]}: pickle files are not read; convert to safetensors)"
            if pickles
            else ""
        )
        raise CheckpointError(
            f"{self.checkpoint_dir} has neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}{hint}"
        )

    def _entry(self, key: str) -> tuple[str, torch.dtype, tuple[int, ...]]:
        if key not in self._entries:
            raise CheckpointError(f"{self.checkpoint_dir}: no tensor named {key!r}")
        return self._entries[key]

    def _handle(self, filename: str):  # safetensors' handle type is not public
        if filename not in self._handles:
            path = self.checkpoint_dir / filename
            try:
                self._handles[filename] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as error:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: cannot open safetensors file: {error}") from None
        return self._handles[filename]

    def keys(self) -> list[str]:
        """All tensor keys, in file order."""
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def fqn_to_file(self) -> dict[str, str]:
        """Key -> file name; pass it to ``save_hf_checkpoint`` to keep the source's layout."""
        return {key: entry[0] for key, entry in self._entries.items()}

    def file_of(self, key: str) -> Path:
        """Path of the file holding ``key``."""
        return self.checkpoint_dir / self._entry(key)[0]

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of ``key`` as stored."""
        return self._entry(key)[2]

    def dtype(self, key: str) -> torch.dtype:
        """Dtype of ``key`` as stored."""
        return self._entry(key)[1]

    def get(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read a whole tensor.

        Args:
            key: tensor name.
            dtype: cast to this dtype; None keeps the stored one.

        Returns:
            A CPU tensor.

        Raises:
            CheckpointError: unknown key.
        """
        filename = self._entry(key)[0]
        tensor = self._handle(filename).get_tensor(key)
        return tensor if dtype is None else tensor.to(dtype)

    def get_rows(
        self, key: str, start: int, stop: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Read rows ``start:stop`` of a tensor, touching only those bytes.

        Args:
            key: tensor name.
            start: first row.
            stop: one past the last row (``start <= stop <= shape[0]``).
            dtype: cast to this dtype; None keeps the stored one.

        Returns:
            A CPU tensor of shape ``[stop - start, *shape[1:]]``.

        Raises:
            CheckpointError: unknown key, scalar tensor or rows out of range.
        """
        filename, _, shape = self._entry(key)
        if not shape or not 0 <= start <= stop <= shape[0]:
            raise CheckpointError(
                f"{self.checkpoint_dir / filename}: rows {start}:{stop} out of range for "
                f"{key!r} of shape {shape}"
            )
        tensor = self._handle(filename).get_slice(key)[start:stop]
        return tensor if dtype is None else tensor.to(dtype)

    def close(self) -> None:
        """Drop the open file handles (they are reopened on demand)."""
        self._handles.clear()

    def __enter__(self) -> "HFCheckpointReader":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---- writing ------------------------------------------------------------------------------
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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_config(config: Mapping, path: Path, torch_dtype: torch.dtype | None) -> None:
    config = dict(config)
    if torch_dtype is not None:
        # transformers 4 reads `torch_dtype`, transformers 5 `dtype`: write both.
        config["torch_dtype"] = config["dtype"] = str(torch_dtype).removeprefix("torch.")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def copy_model_files(
    source_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    torch_dtype: torch.dtype | None = None,
) -> list[str]:
    """Copy config, tokenizer and generation files (``MODEL_FILE_PATTERNS``) to ``output_dir``.

    Weights and adapter files are never copied: a folder with ``adapter_config.json`` next to
    merged weights would make transformers apply the adapter twice.

    Args:
        source_dir: the checkpoint the weights came from.
        output_dir: an existing directory.
        torch_dtype: if given, ``config.json`` records it as ``torch_dtype`` and ``dtype``.

    Returns:
        The names copied.

    Raises:
        CheckpointError: ``source_dir`` does not exist or its ``config.json`` is not JSON.
    """
    source, output = Path(source_dir), Path(output_dir)
    if not source.is_dir():
        raise CheckpointError(f"source directory {source} does not exist")
    copied = []
    for pattern in MODEL_FILE_PATTERNS:
        for path in sorted(source.glob(pattern)):
            if not path.is_file() or path.name in copied:
                continue
            if path.name == "config.json":
                try:
                    config = json.loads(path.read_text())
                except ValueError:
                    raise CheckpointError(f"{path}: not valid JSON") from None
                _write_config(config, output / path.name, torch_dtype)
            else:
                shutil.copyfile(path, output / path.name)
            copied.append(path.name)
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
            _fsync(temp / filename)
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
