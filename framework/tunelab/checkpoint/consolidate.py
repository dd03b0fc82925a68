"""Write final Hugging Face safetensors files from sharded state, through DCP.

``HFSafetensorsWriter`` is a ``torch.distributed.checkpoint`` storage writer. DCP's planner
tells the coordinator every rank's chunks with global shapes and dtypes, so the coordinator
lays out every output file once (``prepare_global_plan``) and sends each rank the byte offset
of each of its chunks. Every rank then ``pwrite``s its chunks straight into the final,
pre-sized files; a ``Shard(0)`` chunk of a row-major tensor is one contiguous byte range, and
other placements are written as their contiguous runs. DCP's finish step (coordinator only,
after all writes) writes the headers, sets the exact file sizes, renames the files into place
and writes ``model.safetensors.index.json``. Every byte is written once, by one rank, with no
temporary shard folder and no whole-file buffers.

Usage::

    dcp.save(state_dict, storage_writer=HFSafetensorsWriter(out, fqn_to_file=weight_map))
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tunelab._fs import fsync_path
from tunelab.checkpoint._safetensors_layout import (
    FileLayout,
    TensorSpec,
    assign_files,
    build_file_layout,
    pwrite_all,
    start_writeback,
    write_chunk,
)
from tunelab.checkpoint.hf_write import parse_size
from tunelab.errors import CheckpointError, ConfigError
from tunelab.formats.hf import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from tunelab.formats.integrity import FileRecord, digest, record_of, record_of_ranges
from tunelab.formats.layout import temporary_name

__all__ = ["HFSafetensorsWriter", "temp_name"]

DEFAULT_MAX_SHARD_SIZE = "5GB"


def temp_name(file_name: str) -> str:
    """The hidden name a file or folder is written under until it is renamed into place."""
    return temporary_name(file_name, "partial")


class HFSafetensorsWriter(StorageWriter):
    """DCP storage writer that writes consolidated Hugging Face safetensors files directly.

    The output folder gets the safetensors files and, unless the only file is
    ``model.safetensors``, ``model.safetensors.index.json`` (what ``save_pretrained`` does).
    No DCP ``.metadata`` file is written: Hugging Face readers ignore it, and
    ``dcp.HuggingFaceStorageReader`` rebuilds DCP metadata from the safetensors headers.
    Only tensors (plain or ``DTensor``, any placement) can be saved.

    Args:
        path: Output folder; created by the coordinator if missing.
        fqn_to_file: Key to output file name, e.g. the base model index's ``weight_map``, so
            the export keeps the base model's file names. None packs files greedily.
        max_shard_size: File size limit for greedy packing (bytes, or e.g. ``"5GB"``).
        sync_files: fsync every file before it is renamed into place.
        thread_count: Threads per rank writing chunks concurrently.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        fqn_to_file: Mapping[str, str] | None = None,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        sync_files: bool = True,
        thread_count: int = 1,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.fqn_to_file = dict(fqn_to_file) if fqn_to_file is not None else None
        self.max_shard_size = parse_size(max_shard_size)
        if self.max_shard_size <= 0:
            raise ConfigError(f"max_shard_size must be positive, got {max_shard_size!r}")
        self.sync_files = sync_files
        self.thread_count = max(1, int(thread_count))
        self.is_coordinator = False
        self.rank = 0
        self._layouts: list[FileLayout] = []
        self._weight_map: dict[str, str] = {}
        self.file_records: dict[str, FileRecord] = {}
        """After a save, on the coordinator: each written file's checksum record."""

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new save, optionally into the folder ``checkpoint_id``."""
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self._layouts = []
        self._weight_map = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Any local folder path can hold an export."""
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        """Name the output folder in the planner's storage metadata."""
        return StorageMeta(checkpoint_id=str(self.path))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Remember whether this rank lays out the files and finishes them."""
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Check that only tensors are saved and record this rank's key order.

        Raises:
            CheckpointError: If the state dict holds something other than a tensor.
        """
        key_order: list[str] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise CheckpointError(
                    f"state dict key {item.index.fqn!r} is not a tensor; safetensors stores tensors only"
                )
            if not key_order or key_order[-1] != item.index.fqn:
                key_order.append(item.index.fqn)
        return dataclasses.replace(plan, storage_data=key_order)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Lay out every file once and tell each rank where its chunks go.

        Runs on the coordinator with every rank's deduplicated write items. It also creates
        the output folder and the pre-sized temporary files, before any rank writes.

        Returns:
            The plans, each with ``storage_data`` mapping every key the rank writes to
            (temporary file name, byte offset of the whole tensor's first element).

        Raises:
            CheckpointError: If ranks disagree on a tensor, the chunks do not cover a tensor
                exactly once, or ``fqn_to_file`` misses a key.
        """
        specs = self._collect_specs(plans)
        files = assign_files(list(specs.values()), self.fqn_to_file, self.max_shard_size)
        self._layouts = [build_file_layout(name, file_specs) for name, file_specs in files.items()]
        self._weight_map = {spec.name: name for name, group in files.items() for spec in group}
        where = {
            key: (temp_name(layout.name), offset)
            for layout in self._layouts
            for key, offset in layout.tensor_offsets.items()
        }
        self.path.mkdir(parents=True, exist_ok=True)
        for layout in self._layouts:
            # Truncate to zero first so no byte of an older crashed attempt survives, then
            # pre-size so the filesystem can allocate the file once.
            with open(self.path / temp_name(layout.name), "wb") as handle:
                handle.truncate(layout.total_size)
        return [
            dataclasses.replace(
                plan, storage_data={i.index.fqn: where[i.index.fqn] for i in plan.items}
            )
            for plan in plans
        ]

    def _collect_specs(self, plans: list[SavePlan]) -> dict[str, TensorSpec]:
        key_order: dict[str, None] = {}
        for plan in plans:
            key_order.update(dict.fromkeys(plan.storage_data or []))
        specs: dict[str, TensorSpec] = {}
        covered: dict[str, int] = dict.fromkeys(key_order, 0)
        for plan in plans:
            for item in plan.items:
                data = item.tensor_data
                assert data is not None, "tensor write items always carry tensor_data"
                spec = TensorSpec(item.index.fqn, data.properties.dtype, tuple(data.size))
                if specs.setdefault(spec.name, spec) != spec:
                    raise CheckpointError(
                        f"ranks disagree on tensor {spec.name!r}: {specs[spec.name]} vs {spec}"
                    )
                covered[spec.name] += torch.Size(data.chunk.sizes).numel()
        for name, spec in specs.items():
            if covered[name] != torch.Size(spec.shape).numel():
                raise CheckpointError(
                    f"tensor {name!r}: ranks write {covered[name]} elements, the tensor has "
                    f"{torch.Size(spec.shape).numel()} (a placement such as Partial cannot be saved)"
                )
        return {name: specs[name] for name in key_order if name in specs}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's chunks into the pre-sized files at their offsets.

        Returns:
            A completed future with one ``WriteResult`` per chunk.
        """
        where: dict[str, tuple[str, int]] = plan.storage_data or {}
        fds: dict[str, int] = {}
        try:
            for temp_name, _ in where.values():
                if temp_name not in fds:
                    # No O_TRUNC: other ranks write into the same file concurrently.
                    fds[temp_name] = os.open(self.path / temp_name, os.O_WRONLY | os.O_CREAT, 0o644)

            def write_item(item: WriteItem) -> WriteResult:
                temp_name, tensor_offset = where[item.index.fqn]
                tensor = planner.resolve_data(item)
                chunk = item.tensor_data.chunk
                if tuple(tensor.shape) != tuple(chunk.sizes) or (
                    tensor.dtype != item.tensor_data.properties.dtype
                ):
                    raise CheckpointError(
                        f"tensor {item.index.fqn!r}: the data to write is {tensor.dtype} "
                        f"{tuple(tensor.shape)}, the plan says {item.tensor_data.properties.dtype} "
                        f"{tuple(chunk.sizes)} (a local transform must keep both)"
                    )
                try:
                    pieces = write_chunk(
                        fds[temp_name],
                        tensor,
                        item.tensor_data.size,
                        chunk.offsets,
                        tensor_offset,
                        hasher,
                    )
                except OSError as error:  # pwrite names no file: name it
                    raise OSError(
                        error.errno, error.strerror, str(self.path / temp_name)
                    ) from error
                num_bytes = sum(length for _, length, _ in pieces)
                if self.sync_files:
                    # Overlap the disk with the next tensors' merge and writes; fsync below.
                    whole = item.tensor_data.size.numel() * tensor.element_size()
                    start_writeback(fds[temp_name], tensor_offset, whole)
                return WriteResult(
                    index=item.index,
                    size_in_bytes=num_bytes,
                    storage_data=(temp_name, pieces),
                )

            # Ranks start on different files: writes to one file contend for its inode lock.
            files = sorted(fds)
            items = sorted(
                plan.items,
                key=lambda item: (files.index(where[item.index.fqn][0]) - self.rank) % len(files),
            )
            # One thread hashes each piece while it is being written.
            with ThreadPoolExecutor(1) as hasher:
                if self.thread_count > 1 and len(items) > 1:
                    with ThreadPoolExecutor(self.thread_count) as pool:
                        results = list(pool.map(write_item, items))
                else:
                    results = [write_item(item) for item in items]
            if self.sync_files:
                for fd in fds.values():
                    os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write headers, set exact sizes, rename files into place and write the index.

        Runs on the coordinator after every rank's ``write_data`` returned.

        Raises:
            CheckpointError: If the ranks did not write exactly the planned number of bytes.
        """
        written = sum(result.size_in_bytes for rank in results for result in rank)
        expected = sum(layout.total_size - len(layout.header) for layout in self._layouts)
        if written != expected:
            raise CheckpointError(
                f"export to {self.path}: ranks wrote {written} tensor bytes, expected {expected}"
            )
        pieces: dict[str, list[tuple[int, int, str]]] = {}
        for rank in results:
            for result in rank:
                file_name, chunk_pieces = result.storage_data
                pieces.setdefault(file_name, []).extend(chunk_pieces)
        records: dict[str, FileRecord] = {}
        for layout in self._layouts:
            header_piece = (0, len(layout.header), digest(layout.header))
            records[layout.name] = record_of_ranges(
                [header_piece, *pieces.get(temp_name(layout.name), [])], layout.total_size
            )
        for layout in self._layouts:
            temp_path = self.path / temp_name(layout.name)
            fd = os.open(temp_path, os.O_WRONLY)
            try:
                pwrite_all(fd, memoryview(layout.header), 0)
                os.ftruncate(fd, layout.total_size)
                if self.sync_files:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp_path, self.path / layout.name)
        index_path = self.path / SAFE_WEIGHTS_INDEX_NAME
        if [layout.name for layout in self._layouts] == [SAFE_WEIGHTS_NAME]:
            # One model.safetensors needs no index; an older one would describe other files.
            index_path.unlink(missing_ok=True)
        else:
            index = {
                "metadata": {"total_size": expected},
                "weight_map": dict(sorted(self._weight_map.items())),
            }
            temp_index = self.path / temp_name(SAFE_WEIGHTS_INDEX_NAME)
            payload = (json.dumps(index, indent=2) + "\n").encode()
            with open(temp_index, "wb") as handle:
                handle.write(payload)
                handle.flush()
                if self.sync_files:
                    os.fsync(handle.fileno())
            os.replace(temp_index, index_path)
            records[SAFE_WEIGHTS_INDEX_NAME] = record_of(payload)
        if self.sync_files:
            fsync_path(self.path)
        self.file_records = records
