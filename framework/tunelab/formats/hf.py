"""Hugging Face safetensors checkpoints: names, and a validating reader.

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
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from tunelab._model_files import model_file, open_model_file, read_model_text
from tunelab.errors import CheckpointError

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Files copied next to exported weights: config, tokenizer, generation settings, a
# vision-language model's image preprocessing, licence.
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
    "preprocessor_config.json",
    "processor_config.json",
    "*.tiktoken",
    "LICENSE*",
)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
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
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""The dtype codes of safetensors headers, as torch dtypes (the writer maps them back)."""


def hf_dtype_name(dtype: torch.dtype) -> str:
    """HF's spelling of a dtype in ``config.json`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


# ---- reading ------------------------------------------------------------------------------
def read_safetensors_header(
    path: str | os.PathLike, folder: str | os.PathLike | None = None
) -> dict[str, dict]:
    """Parse and check a safetensors header without reading tensor data.

    Args:
        path: the file.
        folder: the model folder it belongs to (links may not lead out of it; see
            ``tunelab._model_files``); the file's parent when None.

    Returns:
        Tensor name -> ``{"dtype", "shape", "data_offsets"}`` (``__metadata__`` removed).

    Raises:
        CheckpointError: the file is missing, truncated, or its header is not valid, or it
            is a link out of its folder.
    """
    path = Path(path)
    try:
        with open_model_file(path, folder) as f:
            size = os.fstat(f.fileno()).st_size
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
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            begin, end = entry["data_offsets"]
            numel = 1
            for dim in entry["shape"]:
                _check_count(dim)
                numel *= dim
            _check_count(begin)
            _check_count(end)
            if begin > end:
                raise ValueError(key)
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


def _check_count(value: object) -> None:
    """A size, offset or dimension read from a file: a non-negative int (not a float, not 1e400)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(value)


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
            for key, entry in read_safetensors_header(path, self.checkpoint_dir).items():
                if key in self._entries:
                    raise CheckpointError(
                        f"{path}: {key!r} also appears in {self._entries[key][0]}"
                    )
                self._entries[key] = (
                    filename,
                    SAFETENSORS_DTYPES[entry["dtype"]],
                    tuple(entry["shape"]),
                )
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
                weight_map = json.loads(read_model_text(index, self.checkpoint_dir))["weight_map"]
                assert isinstance(weight_map, dict)
                assert all(isinstance(file, str) for file in weight_map.values())
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
            # The checked path: no link out of the folder, a regular file (mmap'ed).
            path = model_file(self.checkpoint_dir / filename, self.checkpoint_dir)
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
        """Key -> file name; pass it to ``save_hf_sharded`` to keep the source's layout."""
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
