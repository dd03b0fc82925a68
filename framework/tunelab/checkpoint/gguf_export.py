"""GGUF export of a Hugging Face export folder, for llama.cpp, Ollama and LM Studio.

``export_gguf(epoch_dir)`` writes ``epoch_dir/gguf/model-{quant}.gguf``, an Ollama
``Modelfile`` beside it, and a manifest with both files' checksums (``tunelab verify`` checks
them as a sub-folder of the export). The weights are the export's: for LoRA, QLoRA and DoRA
runs the merged model, which the HF export has just written.

Layout and parallel write: the ``gguf`` package's ``GGUFWriter`` writes the header, the
metadata and the tensor table (rank 0); every tensor's offset follows from its size, so each
rank reads its share of tensors from the safetensors files (one run of consecutive tensors
per rank, split by bytes), converts and quantizes them with the ``gguf`` package's quantizers
(a block needs only its own 32 or 256 values), and ``pwrite``s them at their offsets in the one
file: cast into page-aligned buffers and written from them with ``O_DIRECT`` while the next
bytes are cast, the two pages a rank's run shares with its neighbours' through the page cache
(``_RangeWriter``). No rank holds more than one tensor at a time, and none gathers the model.
The padding between tensors is written as zeros by the tensor's writer, so the file is
byte-identical whatever the number of ranks, and the pieces' digests tile it for the manifest.

Everything goes into ``.gguf.tunelab-partial`` first, fsynced, and replaces ``gguf/`` as a
whole at the end: an interrupted export leaves the previous GGUF folder or none.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import mmap
import os
import resource
import shutil
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.distributed as dist

from tunelab._model_files import read_model_text
from tunelab.checkpoint._safetensors_layout import (
    preallocate,
    pwrite_all,
    start_writeback,
    wait_writeback,
)
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
# Seconds per phase of this process's last ``export_gguf`` (and its minor page faults while it
# read and cast the tensors), for the bench's split of where an export's time goes
# (bench/bench_gguf.py). Filled as the export goes; a failed export leaves what it reached.
_LAST_TIMINGS: dict[str, float] = {}
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
    reader: HFCheckpointReader, tensor: PlannedTensor, config: dict, writer: _RangeWriter
) -> Iterator[tuple[memoryview, bool]]:
    """The tensor's data as stored in the file (unpadded), in consecutive pieces.

    Each piece comes with whether it is already in ``writer``'s buffer. A plain cast (``f32``,
    ``f16``) of a stored tensor is made ``_PIECE_BYTES`` at a time (whole rows; whole heads
    when its rows are permuted) straight into the space ``writer.reserve`` gives: hashed there
    while it is still in the CPU's cache, and written to disk from there. Where the stored type
    is already the file's, the pieces are the mapped source's own bytes. Quantized, stacked
    (MoE) and generated tensors come whole (``_stored``).
    """
    cast = _TORCH_CASTS.get(tensor.qtype)
    if cast is None or tensor.hf_name is None or tensor.sources:
        start = time.perf_counter()
        stored = _stored(reader, tensor, config)
        _add_time("read and cast", start)
        yield stored, False
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
            yield memoryview(part.reshape(-1).view(torch.uint8).numpy()), False
            continue
        space = writer.reserve(part.numel() * cast.itemsize)
        start = time.perf_counter()
        out = space.view(cast).view(part.shape)
        # A plain IEEE cast (round to nearest even, as numpy's astype in gguf.quants.quantize),
        # in torch's vectorized kernel. From bfloat16 it equals the cast through float32.
        if tensor.permute_heads:  # HF's rotate-half rows to llama.cpp's pairs, as they cast
            heads, half = part.shape[0] // group, group // 2
            out.view(heads, half, 2, -1).copy_(part.view(heads, 2, half, -1).transpose(1, 2))
        else:
            out.copy_(part)
        _add_time("read and cast", start)
        yield memoryview(space.numpy()), True


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
    Only the writes that go through the page cache need it (``_RangeWriter``).
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


# O_DIRECT's unit: file offsets, lengths and buffer addresses of direct writes are multiples of
# a page (a multiple of the logical block size of the disks this runs on).
_PAGE = mmap.PAGESIZE
# Bytes a rank's buffer holds (one direct write each), how many buffers it cycles through (one
# being filled while the others are on their way to disk) and how many threads write them: two
# direct writes in flight per rank, as the disk takes them faster than one at a time (a
# 1 GB export's rank 0 measured in 0.82-1.18 s against 0.86-1.27 s with one, load 4-5).
_BUFFER_BYTES = 4 << 20
_BUFFERS = 5
_WRITERS = 2
# Whether ``_RangeWriter`` may write with O_DIRECT (tests switch it off for the cached path).
_DIRECT = hasattr(os, "O_DIRECT")


_HUGE_PAGE = 2 << 20
# Buffers of ``_BUFFER_BYTES`` kept for the next export in this process (``_RangeWriter``).
_KEPT_BUFFERS: list[torch.Tensor] = []
_KEPT_LOCK = threading.Lock()


def _aligned(size: int) -> torch.Tensor:
    """An uninitialised byte tensor of ``size`` bytes at a 2 MB boundary, in huge pages.

    Transparent huge pages where the system gives them on request: a direct write pins its
    buffer's pages, and pinning 4 KB pages one by one took about a tenth of the export's CPU.
    """
    mapped = mmap.mmap(-1, size + _HUGE_PAGE)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    skip = -whole.data_ptr() % _HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapped.madvise(mmap.MADV_HUGEPAGE, skip, size)
    return whole[skip : skip + size]


def _take_buffer() -> torch.Tensor:
    """A buffer of ``_BUFFER_BYTES``: one kept from an earlier export, else a new one.

    Kept because fresh memory costs more than reused memory: touching it faults, and where a
    VM's freed memory goes back to its host, on the host too (see ``_WriteBehind``).
    """
    with _KEPT_LOCK:
        for index, buffer in enumerate(_KEPT_BUFFERS):
            if len(buffer) == _BUFFER_BYTES:
                return _KEPT_BUFFERS.pop(index)
    return _aligned(_BUFFER_BYTES)


class _RangeWriter:
    """Writes a rank's byte ranges of the GGUF file through page-aligned buffers.

    ``begin(offset)`` starts a range (a run of consecutive tensors with their padding); its
    bytes are cast into ``reserve``'d space (then ``advance``) or copied in (``write``);
    ``end()`` finishes it.

    With ``sync_files``, where the file system takes ``O_DIRECT``, each page wholly inside a
    range goes to disk straight from the buffer (no copy into the page cache, no cached page to
    drop later, none taken fresh from a VM's host) in writer threads, while the next bytes are
    cast into the next buffer: the disk works while the CPU does. The partial pages at either
    end of a range, which hold the neighbouring bytes too (maybe another rank's), go
    through the page cache, as does everything without ``O_DIRECT`` or without ``sync_files``
    (then kept to a few tens of MB by ``_WriteBehind``). The file's bytes are the same.
    """

    def __init__(self, path: Path, sync_files: bool) -> None:
        self.fd = os.open(path, os.O_WRONLY)
        self.direct: int | None = None
        if sync_files and _DIRECT:
            try:
                self.direct = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:  # a file system without O_DIRECT (tmpfs before Linux 6.6)
                self.direct = None
        self.behind = _WriteBehind(self.fd, sync_files)
        self.executor = (
            ThreadPoolExecutor(_WRITERS, thread_name_prefix="gguf-write")
            if self.direct is not None
            else None
        )
        self.buffers: list[torch.Tensor] = [_take_buffer()]
        self.pending: list[Future | None] = [None]
        # The bytes of shared pages, written once the direct writes are done: a write through
        # the page cache waits for the file's lock, which a direct write holds until its bytes
        # are on disk (ext4).
        self.edges: list[tuple[int, bytes]] = []
        self.slot = 0
        self.base = self.start = self.fill = 0  # the buffer holds [base, base + fill)

    @property
    def position(self) -> int:
        """The file offset of the next byte of the range."""
        return self.base + self.fill

    def begin(self, offset: int) -> None:
        """Start a range at file offset ``offset``."""
        self.base = offset - offset % _PAGE if self.direct is not None else offset
        self.start, self.fill = offset, offset - self.base

    def reserve(self, size: int) -> torch.Tensor:
        """The next ``size`` bytes of the range, in the buffer, to be filled, then ``advance``d."""
        buffer = self.buffers[self.slot]
        if self.fill + size > len(buffer):
            self._flush(final=False)
            buffer = self.buffers[self.slot]
        if self.fill + size > len(buffer):  # one piece larger than a buffer
            larger = _aligned(self.fill + size)
            larger[: self.fill] = buffer[: self.fill]
            self.buffers[self.slot] = buffer = larger
        return buffer[self.fill : self.fill + size]

    def advance(self, size: int) -> None:
        """Count ``size`` bytes of ``reserve``'d space as written."""
        self.fill += size

    def write(self, data: memoryview | bytes) -> None:
        """Copy ``data`` into the range."""
        data = memoryview(data).cast("B")
        done = 0
        while done < len(data):
            size = min(len(data) - done, max(len(self.buffers[self.slot]) - self.fill, _PAGE))
            space = self.reserve(size)
            space.numpy()[:] = np.frombuffer(data[done : done + size], dtype=np.uint8)
            self.advance(size)
            done += size

    def end(self) -> None:
        """Finish the range: everything in the buffer goes to the file."""
        self._flush(final=True)

    def _flush(self, final: bool) -> None:
        buffer = self.buffers[self.slot]
        start, end = self.start, self.base + self.fill
        if self.direct is None:  # all through the page cache
            if end > start:
                pwrite_all(
                    self.fd, memoryview(buffer[start - self.base : end - self.base].numpy()), start
                )
                self.behind.written(start, end - start)
            self.base = self.start = end
            self.fill = 0
            return
        first = min(-(-start // _PAGE) * _PAGE, end)  # the range's first whole page
        last = max(end - end % _PAGE, first)  # the end of its whole pages
        view = memoryview(buffer.numpy())
        if first > start:  # a page shared with the bytes before the range
            self.edges.append((start, bytes(view[start - self.base : first - self.base])))
        if final and end > last:  # one shared with the bytes after it
            self.edges.append((last, bytes(view[last - self.base : end - self.base])))
        if last > first:
            assert self.executor is not None
            self.pending[self.slot] = self.executor.submit(
                self._write_direct, view[first - self.base : last - self.base], first
            )
            self._next_buffer()
        carry = 0 if final else end - last
        if carry and last > self.base:  # the bytes of a page not yet whole, to the front
            self.buffers[self.slot][:carry] = buffer[last - self.base : end - self.base]
        self.base = self.start = last if carry else end
        self.fill = carry
        if not carry:
            self.base -= self.base % _PAGE
            self.fill = self.start - self.base

    def _next_buffer(self) -> None:
        """Move to a buffer no write still reads from (a new one while fewer than ``_BUFFERS``)."""
        if len(self.buffers) < _BUFFERS:
            self.buffers.append(_take_buffer())
            self.pending.append(None)
            self.slot = len(self.buffers) - 1
            return
        self.slot = (self.slot + 1) % len(self.buffers)
        pending, self.pending[self.slot] = self.pending[self.slot], None
        if pending is not None:
            start = time.perf_counter()
            pending.result()
            _add_time("wait for a free buffer", start)

    def _write_direct(self, data: memoryview, offset: int) -> None:
        assert self.direct is not None
        try:
            pwrite_all(self.direct, data, offset)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            pwrite_all(self.fd, data, offset)  # this file system refuses these direct writes

    def sync(self) -> None:
        """Finish the file: shared pages' bytes last, fsync, its clean pages dropped."""
        start = time.perf_counter()
        for index, pending in enumerate(self.pending):
            self.pending[index] = None
            if pending is not None:
                pending.result()
        start = _add_time("drain the last direct writes", start)
        for offset, data in self.edges:
            pwrite_all(self.fd, memoryview(data), offset)
        self.edges.clear()
        start = _add_time("shared pages through the cache", start)
        os.fsync(self.fd)
        start = _add_time("fsync", start)
        self.behind.synced()

    def close(self) -> None:
        """Wait for the writer threads (whatever failed), close the file, keep the buffers."""
        try:
            if self.executor is not None:
                self.executor.shutdown(wait=True)
        finally:
            if self.direct is not None:
                os.close(self.direct)
            os.close(self.fd)
        with _KEPT_LOCK:
            _KEPT_BUFFERS.extend(b for b in self.buffers if len(b) == _BUFFER_BYTES)
        self.buffers = []


def _shares(plan: list[PlannedTensor], world_size: int) -> list[int]:
    """Which rank writes each tensor: one run of consecutive tensors per rank, split by bytes.

    Each tensor goes to the rank whose ``1 / world_size`` of the data its middle byte falls in.
    Consecutive tensors make one range for ``_RangeWriter``: its direct writes are whole
    buffers across tensor boundaries, and only the pages at either end of a rank's run go
    through the page cache (a split largest-first interleaved the ranks' tensors: two shared
    pages per tensor, and a short direct write at the end of each).
    """
    total = sum(_padded(tensor.nbytes) for tensor in plan)
    owner, position = [], 0
    for tensor in plan:
        middle = position + _padded(tensor.nbytes) // 2
        owner.append(min(world_size - 1, middle * world_size // max(total, 1)))
        position += _padded(tensor.nbytes)
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
    writer = _RangeWriter(path, sync_files)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start_loop = time.perf_counter()
    try:
        with HFCheckpointReader(export_dir) as reader:
            run_end = None  # where the range being written ends, if one is
            for index in mine:
                tensor, offset = plan[index], offsets[index]
                hasher = digester()
                if offset != run_end:  # not right after this rank's previous tensor
                    if run_end is not None:
                        writer.end()
                    writer.begin(offset)
                for piece, placed in _stored_pieces(reader, tensor, config, writer):
                    start = time.perf_counter()
                    hasher.update(piece)
                    _add_time("digest", start)
                    if placed:
                        writer.advance(len(piece))
                    else:
                        writer.write(piece)
                position = writer.position
                assert position - offset == tensor.nbytes, (tensor.name, position - offset)
                # The padding too, so the file's bytes never depend on what was there before.
                padding = bytes(_padded(tensor.nbytes) - tensor.nbytes)
                writer.write(padding)
                run_end = writer.position
                pieces += [
                    (offset, tensor.nbytes, hasher.hexdigest()),
                    (position, len(padding), digest(padding)),
                ]
            if run_end is not None:
                writer.end()
        _LAST_TIMINGS["minor page faults"] = (
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        )
        _add_time("tensor loop", start_loop)
        if sync_files:
            writer.sync()
    finally:
        writer.close()
    return pieces


def _add_time(phase: str, start: float) -> float:
    """Add the seconds since ``start`` to ``phase`` in ``_LAST_TIMINGS``; return the time now."""
    now = time.perf_counter()
    _LAST_TIMINGS[phase] = _LAST_TIMINGS.get(phase, 0.0) + now - start
    return now


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
    _LAST_TIMINGS.clear()
    start = time.perf_counter()
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
    start = _add_time("plan", start)
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
                preallocate(handle.fileno(), data_start + total)  # few extents; direct writes
                # to allocated blocks share the file's lock (ext4)
            message = [None, data_start]
        except (OSError, TunelabError) as error:
            message = [str(error), 0]
    if distributed:
        dist.broadcast_object_list(message, group=process_group, group_src=0)
    if message[0] is not None:
        raise CheckpointError(message[0])
    data_start = message[1]
    start = _add_time("header and preallocation (rank 0; the others wait)", start)
    owner = _shares(plan, world_size)
    mine = [i for i, r in enumerate(owner) if r == rank]
    try:
        pieces = _write_tensors(path, export_dir, config, plan, data_start, mine, sync_files)
    except Exception as error:  # noqa: BLE001 - any failure is told to rank 0: no rank hangs
        pieces = f"rank {rank}: {type(error).__name__}: {error}"
    start = _add_time("tensors, written and fsynced", start)
    if rank == 0 and isinstance(pieces, list):
        pieces.append((0, data_start, digest(header)))
    gathered = [pieces]
    if distributed:
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(pieces, gathered, group=process_group, group_dst=0)
    start = _add_time("gather the digests (waits for the slowest rank)", start)
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
    start = _add_time("finish (rank 0)", start)
    if distributed:
        result = [failure]
        dist.broadcast_object_list(result, group=process_group, group_src=0)
        failure = result[0]
    _add_time("broadcast the outcome", start)
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
    start = time.perf_counter()
    _swap_into_place(staging, final, sync_files)
    _add_time("of the finish: swap into place, the previous folder removed", start)
