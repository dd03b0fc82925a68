"""DCP checkpoint metadata as JSON, so that loading a step checkpoint never unpickles.

``torch.distributed.checkpoint``'s ``FileSystemWriter`` pickles its ``Metadata`` into
``.metadata`` and ``FileSystemReader`` unpickles it: a crafted file would run code on every
rank at resume. tunelab writes the same information as ``.metadata.json`` instead and reads it
back through a strict parser that accepts tensor entries only (a ``BytesStorageMetadata`` entry
would make DCP ``torch.load`` the bytes with ``weights_only=False``), known dtypes only, and no
storage transforms. Format 2 (``_tensor_files``) stores each item as its raw bytes, described by this
metadata (dtype and chunk shape); format 1, written by tunelab before it, stored ``torch.save``
records, which are still read, by DCP with ``torch.load(weights_only=True)``.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tunelab.errors import CheckpointError

METADATA_JSON_NAME = ".metadata.json"
"""The JSON form of a step checkpoint's DCP metadata (there is no pickled ``.metadata``)."""
_FORMAT = "tunelab-dcp-metadata/2"
_TORCH_SAVE_FORMAT = "tunelab-dcp-metadata/1"  # items are torch.save records (still read)
_DTYPES = {
    str(dtype): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class StorageInfo:
    """Where one saved item lives: the fields DCP's ``FileSystemReader`` reads."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: None = None


def holds_raw_records(data: dict[str, Any]) -> bool:
    """Whether metadata that :func:`from_json` accepted describes raw tensor files."""
    return data["format"] == _FORMAT


def to_json(
    metadata: Metadata, storage_data: dict[MetadataIndex, Any], *, raw_records: bool = True
) -> dict[str, Any]:
    """Encode DCP metadata and the items' storage locations as plain JSON values.

    Args:
        metadata: What DCP planned.
        storage_data: Where each item was written.
        raw_records: The items are raw bytes (False: ``torch.save`` records, format 1).

    Raises:
        CheckpointError: If the state holds something other than strided tensors of a known
            dtype, or a storage transform (both never happen in tunelab's own saves).
    """
    tensors = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"state dict key {fqn!r} is not a tensor; only tensors are saved")
        properties = entry.properties
        if str(properties.dtype) not in _DTYPES or properties.layout != torch.strided:
            raise CheckpointError(f"state dict key {fqn!r}: cannot save {properties.dtype} tensors")
        tensors[fqn] = {
            "dtype": str(properties.dtype),
            "size": list(entry.size),
            "chunks": [[list(c.offsets), list(c.sizes)] for c in entry.chunks],
        }
    items = []
    for index, info in storage_data.items():
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{index.fqn!r}: storage transforms are not supported")
        offset = None if index.offset is None else list(index.offset)
        items.append([index.fqn, offset, index.index, info.relative_path, info.offset, info.length])
    mappings = metadata.planner_data or {}
    return {
        "format": _FORMAT if raw_records else _TORCH_SAVE_FORMAT,
        "version": metadata.version,
        "tensors": tensors,
        "items": items,
        "planner_data": {key: list(path) for key, path in mappings.items()},
    }


def from_json(data: Any, source: str) -> Metadata:
    """Decode what :func:`to_json` wrote into DCP ``Metadata``, validating every field.

    Args:
        data: The parsed JSON.
        source: The file it came from (named in errors).

    Raises:
        CheckpointError: If anything is not exactly what :func:`to_json` writes.
    """
    try:
        if data["format"] not in (_FORMAT, _TORCH_SAVE_FORMAT):
            raise ValueError(f"format {data['format']!r}, expected {_FORMAT!r}")
        state_dict_metadata = {}
        for fqn, entry in data["tensors"].items():
            dtype = _DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{fqn}: unsupported dtype {entry['dtype']!r}")
            state_dict_metadata[_text(fqn)] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype),
                size=_size(entry["size"]),
                chunks=[
                    ChunkStorageMetadata(offsets=_size(offsets), sizes=_size(sizes))
                    for offsets, sizes in entry["chunks"]
                ],
            )
        storage_data = {}
        for fqn, offset, index, relative_path, file_offset, length in data["items"]:
            key = MetadataIndex(
                fqn=_text(fqn),
                offset=None if offset is None else _size(offset),
                index=None if index is None else _count(index),
            )
            name = _text(relative_path)
            if "/" in name or "\\" in name or name.startswith("."):
                raise ValueError(f"item file {name!r} is not a file of the checkpoint folder")
            storage_data[key] = StorageInfo(name, _count(file_offset), _count(length))
        planner_data = {
            _text(key): tuple(_path_part(part) for part in path)
            for key, path in data["planner_data"].items()
        }
        version = data["version"]
        if version is not None and not isinstance(version, str):
            raise ValueError("version is not a string")
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{source}: malformed checkpoint metadata ({error})") from None
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=planner_data,
        storage_data=storage_data,
        storage_meta=StorageMeta(),
        version=version,
    )


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _size(values: Any) -> torch.Size:
    if not isinstance(values, list):
        raise ValueError(f"expected a list of sizes, got {type(values).__name__}")
    return torch.Size([_count(value) for value in values])


def _path_part(value: Any) -> str | int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return _text(value)
