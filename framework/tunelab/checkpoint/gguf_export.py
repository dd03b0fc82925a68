"""GGUF export of a Hugging Face export folder, for llama.cpp, Ollama and LM Studio.

``export_gguf(epoch_dir)`` writes ``epoch_dir/gguf/model-{quant}.gguf``, an Ollama
``Modelfile`` beside it, and a manifest with both files' checksums (``tunelab verify`` checks
them as a sub-folder of the export). The weights are the export's: for LoRA, QLoRA and DoRA
runs the merged model, which the HF export has just written.

Layout and parallel write: the ``gguf`` package's ``GGUFWriter`` writes the header, the
metadata and the tensor table (rank 0); every tensor's offset follows from its size, so each
rank reads its share of tensors from the safetensors files (a balanced split by bytes, the
largest first), converts and quantizes them with the ``gguf`` package's quantizers (a block
needs only its own 32 or 256 values), and ``pwrite``s them at their offsets in the one file.
No rank holds more than one tensor at a time, and none gathers the model. The padding between
tensors is written as zeros by the tensor's writer, so the file is byte-identical whatever the
number of ranks, and the pieces' digests tile it for the manifest.

Everything goes into ``.gguf.tunelab-partial`` first, fsynced, and replaces ``gguf/`` as a
whole at the end: an interrupted export leaves the previous GGUF folder or none.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.distributed as dist

from tunelab._model_files import read_model_text
from tunelab.checkpoint._safetensors_layout import pwrite_all, start_writeback, wait_writeback
from tunelab.checkpoint.consolidate import temp_name
from tunelab.checkpoint.gguf_vocab import model_name, write_vocab
from tunelab.checkpoint.hf_sharded import _swap_into_place
from tunelab.checkpoint.ollama import modelfile
from tunelab.data.tokenizer import Tokenizer, load_tokenizer
from tunelab.errors import CheckpointError, TunelabError
from tunelab.formats.gguf_model import (
    QUANTIZATIONS,
    PlannedTensor,
    expert_stacks,
    family_of,
    permute_rows,
    plan_tensor,
    quantization_problem,
    rope_freqs,
    write_hparams,
)
from tunelab.formats.hf import HFCheckpointReader
from tunelab.formats.integrity import (
    FileRecord,
    digest,
    digester,
    record_of_ranges,
    write_bytes,
)
from tunelab.formats.layout import write_manifest

__all__ = ["GGUF_DIR_NAME", "export_gguf", "gguf_file_name"]

GGUF_DIR_NAME = "gguf"
"""The folder of an export that holds its GGUF file and Modelfile."""
_ALIGNMENT = gguf.GGUF_DEFAULT_ALIGNMENT
# Bytes of a tensor cast, hashed and written at a time (``_stored_pieces``): the export's CPU
# fell by about a fifth against casting whole tensors (the bytes stay in cache between the three).
_PIECE_BYTES = 1 << 20
_TORCH_CASTS = {
    gguf.GGMLQuantizationType.F32: torch.float32,
    gguf.GGMLQuantizationType.F16: torch.float16,
}


def gguf_file_name(quant: str) -> str:
    """The GGUF file's name for a quantization: ``model-{quant}.gguf``."""
    return f"model-{quant}.gguf"


def _padded(size: int) -> int:
    return -(-size // _ALIGNMENT) * _ALIGNMENT


def _plan(export_dir: Path, config: dict, quant: str) -> list[PlannedTensor]:
    family = family_of(config, str(export_dir / "config.json"))
    qtype = QUANTIZATIONS[quant][0]
    plan = []
    freqs = rope_freqs(config)
    if freqs is not None:
        plan.append(
            PlannedTensor(None, "rope_freqs.weight", freqs.shape, gguf.GGMLQuantizationType.F32, 0)
        )
    with HFCheckpointReader(export_dir) as reader:
        plain, stacks = expert_stacks(sorted(reader.keys()), str(export_dir))
        shapes = {key: tuple(reader.shape(key)) for key in plain}
        for stacked, experts in stacks.items():
            shape = {tuple(reader.shape(key)) for key in experts}
            if len(shape) != 1:
                raise CheckpointError(f"{export_dir}: the experts of {stacked} differ in shape")
            shapes[stacked] = (len(experts), *shape.pop())
    for key in sorted(shapes):
        planned = plan_tensor(key, shapes[key], config, family, qtype)
        if planned is not None:
            plan.append(dataclasses.replace(planned, sources=stacks.get(key, ())))
    return plan


def _header(
    export_dir: Path,
    config: dict,
    quant: str,
    plan: list[PlannedTensor],
    path: Path,
    tokenizer: Tokenizer,
) -> int:
    """Write the header, metadata and tensor table to ``path``; return their length."""
    family = family_of(config, str(export_dir / "config.json"))
    writer = gguf.GGUFWriter(None, family.name)
    writer.add_type(gguf.GGUFType.MODEL)
    write_hparams(writer, config, family, QUANTIZATIONS[quant][1], str(export_dir / "config.json"))
    added = write_vocab(writer, export_dir, tokenizer, config["vocab_size"])
    writer.add_name(model_name(export_dir.resolve().name, added))
    for tensor in plan:
        writer.add_tensor_info(
            tensor.name, tensor.shape, np.dtype(np.float32), tensor.nbytes, raw_dtype=tensor.qtype
        )
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    size = writer.fout[0].tell()
    writer.close()
    return size


def _stored(reader: HFCheckpointReader, tensor: PlannedTensor, config: dict) -> memoryview:
    """The tensor's data as stored in the file (its bytes, unpadded)."""
    if tensor.hf_name is None:
        data = torch.from_numpy(rope_freqs(config))
    elif tensor.sources:  # an MoE layer's experts, stacked
        data = torch.stack([reader.get(key) for key in tensor.sources])
    else:
        data = reader.get(tensor.hf_name)  # as stored: a plain cast goes straight to its type
    cast = _TORCH_CASTS.get(tensor.qtype)
    if cast is None or tensor.offset:
        data = data.float()  # the gguf quantizers take float32; Gemma's +1 is added in it
    if tensor.offset:
        data = data + tensor.offset
    if cast is not None:
        # A plain IEEE cast (round to nearest even, as numpy's astype in gguf.quants.quantize),
        # in torch's vectorized kernel: several times faster than numpy's float16 cast. From
        # bfloat16 it equals the cast through float32 (bfloat16 -> float32 is exact).
        data = data.to(cast)
    if tensor.permute_heads:  # a reordering of rows: after the cast it moves fewer bytes
        data = permute_rows(data, tensor.permute_heads)
    if cast is not None:
        stored = data.contiguous().numpy()
    else:
        stored = gguf.quants.quantize(np.ascontiguousarray(data.numpy()), tensor.qtype)
    stored = np.ascontiguousarray(stored)
    assert stored.nbytes == tensor.nbytes, (tensor.name, stored.nbytes, tensor.nbytes)
    return memoryview(stored.reshape(-1).view(np.uint8))


def _stored_pieces(
    reader: HFCheckpointReader, tensor: PlannedTensor, config: dict, buffers: list[torch.Tensor]
) -> Iterator[memoryview]:
    """The tensor's data as stored in the file (unpadded), in consecutive pieces.

    A plain cast (``f32``, ``f16``) of a stored tensor is made ``_PIECE_BYTES`` at a time
    (whole rows; whole heads when its rows are permuted) into ``buffers[0]``, which each piece
    overwrites: written and hashed while it is still in the CPU's cache. Where the stored type
    is already the file's, the pieces are the mapped source's own bytes. Quantized, stacked
    (MoE) and generated tensors come whole (``_stored``).
    """
    cast = _TORCH_CASTS.get(tensor.qtype)
    if cast is None or tensor.hf_name is None or tensor.sources:
        yield _stored(reader, tensor, config)
        return
    data = reader.get(tensor.hf_name)  # a view of the mapped file: read as it is cast
    rows = data.reshape(data.shape[0], -1)
    group = rows.shape[0] // tensor.permute_heads if tensor.permute_heads else 1
    step = max(1, _PIECE_BYTES // (rows.shape[1] * cast.itemsize * group)) * group
    for start in range(0, rows.shape[0], step):
        part = rows[start : start + step]
        if tensor.offset:
            part = part.float() + tensor.offset
        if part.dtype == cast and not tensor.permute_heads:
            yield memoryview(part.reshape(-1).view(torch.uint8).numpy())
            continue
        size = part.numel() * cast.itemsize
        if buffers[0].numel() < size:
            buffers[0] = torch.empty(max(size, _PIECE_BYTES), dtype=torch.uint8)
        out = buffers[0][:size].view(cast).view(part.shape)
        # A plain IEEE cast (round to nearest even, as numpy's astype in gguf.quants.quantize),
        # in torch's vectorized kernel. From bfloat16 it equals the cast through float32.
        if tensor.permute_heads:  # HF's rotate-half rows to llama.cpp's pairs, as they cast
            heads, half = part.shape[0] // group, group // 2
            out.view(heads, half, 2, -1).copy_(part.view(heads, 2, half, -1).transpose(1, 2))
        else:
            out.copy_(part)
        yield memoryview(buffers[0][:size].numpy())


# Bytes written but still cached before the oldest are waited for on disk and dropped from the
# page cache (``_WriteBehind``).
_WRITE_BEHIND_BYTES = 64 << 20


class _WriteBehind:
    """Keeps at most ``_WRITE_BEHIND_BYTES`` of the written file in the page cache.

    Each written range's writeback starts at once; older ranges are waited for on disk and
    dropped. So an export recycles a few tens of MB of cache instead of taking a new page for
    every byte of the file while the previous export still holds its own (and that one's
    deletion then frees no cached pages). Where freed memory goes back to a hypervisor (a VM's
    free page reporting), a page not reused soon costs a fault on the host when touched again:
    measured in such a VM, a 1 GB export's CPU fell from 1.9 s per rank in its bad rounds to
    0.33-0.43 s in every round (docs/benchmarks.md). Without ``fsync`` the pages stay (dirty).
    """

    def __init__(self, fd: int, sync_files: bool) -> None:
        self.fd, self.sync_files = fd, sync_files
        self.cached: deque[tuple[int, int]] = deque()
        self.cached_bytes = 0

    def written(self, offset: int, length: int) -> None:
        """Record that ``length`` bytes at ``offset`` were written."""
        if not self.sync_files:
            return
        start_writeback(self.fd, offset, length)
        if not hasattr(os, "posix_fadvise"):
            return
        self.cached.append((offset, length))
        self.cached_bytes += length
        while self.cached_bytes > _WRITE_BEHIND_BYTES:
            offset, length = self.cached.popleft()
            self.cached_bytes -= length
            wait_writeback(self.fd, offset, length)
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)

    def synced(self) -> None:
        """After ``fsync``: drop the whole file's clean pages (other ranks' dirty ones stay)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.cached.clear()
        self.cached_bytes = 0


def _shares(plan: list[PlannedTensor], world_size: int) -> list[int]:
    """Which rank writes each tensor: largest first, to the least loaded rank."""
    load = [0] * world_size
    owner = [0] * len(plan)
    for index in sorted(range(len(plan)), key=lambda i: (-plan[i].nbytes, i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += plan[index].nbytes
    return owner


def _write_tensors(
    path: Path,
    export_dir: Path,
    config: dict,
    plan: list[PlannedTensor],
    data_start: int,
    mine: list[int],
    sync_files: bool,
) -> list[tuple[int, int, str]]:
    offsets, position = [], data_start
    for tensor in plan:
        offsets.append(position)
        position += _padded(tensor.nbytes)
    pieces = []
    buffers = [torch.empty(0, dtype=torch.uint8)]
    fd = os.open(path, os.O_WRONLY)
    behind = _WriteBehind(fd, sync_files)
    try:
        with HFCheckpointReader(export_dir) as reader:
            for index in mine:
                tensor, offset = plan[index], offsets[index]
                hasher, position = digester(), offset
                for piece in _stored_pieces(reader, tensor, config, buffers):
                    hasher.update(piece)
                    pwrite_all(fd, piece, position)
                    behind.written(position, len(piece))
                    position += len(piece)
                assert position - offset == tensor.nbytes, (tensor.name, position - offset)
                # The padding too, so the file's bytes never depend on what was there before.
                padding = bytes(_padded(tensor.nbytes) - tensor.nbytes)
                pwrite_all(fd, memoryview(padding), position)
                pieces += [
                    (offset, tensor.nbytes, hasher.hexdigest()),
                    (position, len(padding), digest(padding)),
                ]
        if sync_files:
            os.fsync(fd)
            behind.synced()
    finally:
        os.close(fd)
    return pieces


def export_gguf(
    export_dir: str | os.PathLike,
    *,
    quant: str = "f16",
    process_group: dist.ProcessGroup | None = None,
    sync_files: bool = True,
) -> Path:
    """Write ``export_dir/gguf/``: the GGUF file, an Ollama Modelfile and their manifest.

    All ranks of ``process_group`` call this (or one process without a group).

    Args:
        export_dir: A Hugging Face model folder: an ``epoch_E`` export (config.json,
            safetensors, tokenizer files).
        quant: One of ``QUANTIZATIONS`` (``f16``, ``bf16``, ``f32``, ``q8_0``, ...) that the
            installed ``gguf`` package can write (``quantization_problem``).
        process_group: Group whose ranks share the tensors; None: the default group if one
            is initialised, else this process alone.
        sync_files: fsync the files before they are renamed into place.

    Returns:
        The GGUF file's path.

    Raises:
        CheckpointError: One line when the family, tokenizer or quantization is not supported
            or the folder is not a model export.
    """
    export_dir = Path(export_dir)
    problem = quantization_problem(quant)
    if problem is not None:
        raise CheckpointError(problem)
    config_path = export_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{export_dir} is not a model export (no config.json)")
    config = json.loads(read_model_text(config_path, export_dir))
    config = {**config, **config.get("text_config", {})}
    plan = _plan(export_dir, config, quant)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    world_size = dist.get_world_size(process_group) if distributed else 1
    final = export_dir / GGUF_DIR_NAME
    staging = export_dir / temp_name(GGUF_DIR_NAME)
    name = gguf_file_name(quant)
    path = staging / temp_name(name)
    total = sum(_padded(t.nbytes) for t in plan)
    message: list = [None, 0]
    tokenizer: Tokenizer | None = None
    if rank == 0:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            tokenizer = load_tokenizer(export_dir)  # read once: the header and the Modelfile
            header_size = _header(export_dir, config, quant, plan, path, tokenizer)
            data_start = _padded(header_size)
            with open(path, "r+b") as handle:
                header = handle.read(header_size) + bytes(data_start - header_size)
                handle.seek(0)
                handle.write(header)
                handle.truncate(data_start + total)
            message = [None, data_start]
        except (OSError, TunelabError) as error:
            message = [str(error), 0]
    if distributed:
        dist.broadcast_object_list(message, group=process_group, group_src=0)
    if message[0] is not None:
        raise CheckpointError(message[0])
    data_start = message[1]
    owner = _shares(plan, world_size)
    mine = [i for i, r in enumerate(owner) if r == rank]
    try:
        pieces = _write_tensors(path, export_dir, config, plan, data_start, mine, sync_files)
    except Exception as error:  # noqa: BLE001 - any failure is told to rank 0: no rank hangs
        pieces = f"rank {rank}: {type(error).__name__}: {error}"
    if rank == 0 and isinstance(pieces, list):
        pieces.append((0, data_start, digest(header)))
    gathered = [pieces]
    if distributed:
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(pieces, gathered, group=process_group, group_dst=0)
    failure = None
    if rank == 0:
        try:
            failure = next((part for part in gathered if isinstance(part, str)), None)
            if failure is None:
                assert tokenizer is not None  # rank 0 read it for the header
                _finish(
                    staging,
                    final,
                    path,
                    name,
                    gathered,
                    data_start + total,
                    tokenizer,
                    sync_files,
                )
        except (OSError, TunelabError) as error:
            failure = str(error)
        if failure is not None:
            shutil.rmtree(staging, ignore_errors=True)
    if distributed:
        result = [failure]
        dist.broadcast_object_list(result, group=process_group, group_src=0)
        failure = result[0]
    if failure is not None:
        raise CheckpointError(f"GGUF export to {final}: {failure}")
    return final / name


def _finish(
    staging: Path,
    final: Path,
    path: Path,
    name: str,
    gathered: list,
    size: int,
    tokenizer: Tokenizer,
    sync_files: bool,
) -> None:
    """Record the file, write the Modelfile and manifest, and swap ``gguf/`` into place."""
    files: dict[str, FileRecord] = {
        name: record_of_ranges([piece for rank in gathered for piece in rank], size)
    }
    os.replace(path, staging / name)
    stops = [tokenizer.id_to_token(i) for i in tokenizer.stop_ids]
    text = modelfile(name, tokenizer.chat_template, [s for s in stops if s])
    files["Modelfile"] = write_bytes(staging / "Modelfile", text.encode())
    write_manifest(staging, files, kind="gguf")
    _swap_into_place(staging, final, sync_files)
