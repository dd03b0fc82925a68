"""Step checkpoint data files: tensors' raw bytes, written and read at the speed of the disk.

A data file of a step checkpoint holds the bytes of one rank's tensors back to back, each at
an offset aligned to ``ALIGN`` bytes, with nothing else: no pickle, no zip records. What each
item is (its tensor, chunk, dtype and shape) is in the checkpoint's JSON metadata; where it is
(file, offset, length) too. The file's manifest record has one checksummed range per item
(the padding before an item belongs to its range), so a reader that needs a few items reads
and verifies only those, and a reader that needs the whole file reads it once, sequentially.

Writing: the file's blocks are reserved first (``fallocate``: files written at once by
several threads keep few extents), then each item's bytes are copied from the staged tensor
into a reused page-aligned staging buffer, each 2 MB piece hashed right after it is copied
(while it is in the core's cache), and the buffer is written with ``O_DIRECT`` each time it
fills (``DIRECT_CHUNK``); the last write is padded to ``DIRECT_ALIGN`` and the file cut to its
length. No page cache is filled: a save runs at the disk's pace instead of waiting for the
kernel to find memory for it. Reading: each wanted item's bytes are read with ``O_DIRECT``
into a staging buffer (nearby items as one stream), each 2 MB piece hashed, then copied to
the destination tensor; a range whose digest differs is :class:`ContentMismatch`. Where the
file system does not take ``O_DIRECT`` (or refuses a write or read midway), the same bytes
are written buffered (2 MB writes, small items gathered, write-back started every
``_WRITEBACK_BYTES``) and read buffered (64 MB reads straight into the destination). The
files of a rank are written and read in parallel threads (``dcp.WRITE_THREADS``,
``dcp.READ_THREADS``).

Measured here (docs/benchmarks.md, "Checkpoint I/O at the disk's speed"): torch's
``FileSystemWriter`` format (a ``torch.save`` zip record per tensor, one thread, fsync at the
end) wrote at 3.7x the raw disk's time for the same bytes and read at 1.3-1.6x. With these
files and direct I/O a 2 GB model's step save takes 0.68-0.86x a buffered raw write + fsync
of the same bytes and its verified resume 0.90x a buffered raw cold read (buffered: save
1.27-1.33x, resume 1.08-1.20x), on 2 ranks and 2 cores, each pair timed in both orders
(session 11; docs/benchmarks.md).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from tunelab.checkpoint._safetensors_layout import preallocate, start_writeback
from tunelab.errors import CheckpointError
from tunelab.formats.integrity import FileRecord, open_regular, record_of_ranges

ALIGN = 64
"""Every item starts at a multiple of this many bytes (a cache line: aligned copies)."""
_PIECE_BYTES = 2 << 20  # large items are hashed and written by pieces of this size: a
# piece is hashed while in the core's cache (2 MB: half of L2 here)
_READ_PIECE_BYTES = 64 << 20  # large items are read (then hashed) by pieces of this size
_GATHER_BYTES = 4 << 20  # items smaller than this are gathered into one buffer per write
_WRITEBACK_BYTES = 64 << 20  # start write-back every this many bytes written
_PADDING = bytes(ALIGN)
DIRECT_ALIGN = 4096
"""``O_DIRECT`` writes start and end at multiples of this (memory address, offset, length)."""
DIRECT_CHUNK = 8 << 20
"""Bytes per ``O_DIRECT`` write (a multiple of ``DIRECT_ALIGN``)."""
_DIRECT_READ_BYTES = 16 << 20  # bytes per O_DIRECT read (at most)
_DIRECT_GAP_BYTES = 1 << 20  # wanted items closer than this are read as one stream


class ContentMismatch(CheckpointError):
    """Bytes read from a step checkpoint differ from the checksum its manifest records."""


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a flat (writable) byte view, without a copy."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    flat = tensor.detach().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _hash(view: memoryview) -> str:
    return xxhash.xxh3_128(view).hexdigest()


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(f"short write: {written} of {len(view)} bytes")
        view, offset = view[written:], offset + written


def write_tensor_file(
    path: Path, tensors: Sequence[torch.Tensor], *, sync: bool, direct: bool = True
) -> tuple[list[tuple[int, int]], FileRecord]:
    """Write ``tensors``' bytes into a new file ``path``, each at an ``ALIGN``-ed offset.

    Args:
        path: The file (created; it must not exist: a step folder is written afresh).
        tensors: CPU tensors (staged copies, or the live state of a blocking save).
        sync: ``fsync`` the file before returning.
        direct: Write with ``O_DIRECT`` through an aligned staging buffer where the file
            system takes it (no page cache is filled); otherwise, or where it refuses,
            buffered writes with early write-back. The file's bytes are the same.

    Returns:
        Each tensor's ``(offset, length)`` in the file, and the file's record: one range per
        tensor (the padding before it included), its XXH3-128 digest taken while writing.

    Raises:
        OSError: If a write fails (the file is named in it).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        # Blocks reserved up front: files written at once by several threads keep few extents.
        length = _file_length(tensors)
        preallocate(fd, length)
        if direct and _set_direct(fd, on=True):
            try:
                return _write_items_direct(fd, tensors, sync)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                # The file system took the flag but not these writes (an alignment larger
                # than DIRECT_ALIGN): start the file again, buffered.
                _set_direct(fd, on=False)
                os.ftruncate(fd, 0)
                preallocate(fd, length)
        return _write_items(fd, tensors, sync)
    except OSError as error:
        raise OSError(error.errno, error.strerror or str(error), str(path)) from None
    finally:
        os.close(fd)


def _layout(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[int, bytes, memoryview]]:
    """Each tensor's range in the file: where it starts, the padding before its bytes, them."""
    position = 0
    for tensor in tensors:
        view = tensor_bytes(tensor)
        padding = _PADDING[: (-position) % ALIGN]
        yield position, padding, view
        position += len(padding) + len(view)


def _file_length(tensors: Sequence[torch.Tensor]) -> int:
    """The length of the file ``tensors`` make: each item's bytes at an ``ALIGN``-ed offset."""
    position = 0
    for tensor in tensors:
        position += (-position) % ALIGN + tensor.numel() * tensor.element_size()
    return position


def _set_direct(fd: int, *, on: bool) -> bool:
    """Switch ``O_DIRECT`` on or off for ``fd``; False where the system or file refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | flag if on else flags & ~flag)
    except OSError:
        return False
    return True


class _StagingBuffers:
    """Page-aligned staging buffers, kept for the next save's threads.

    Reusing them spares each save the page faults of fresh memory (and this VM's balloon
    the work of taking back and giving again what a freed buffer held).
    """

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    @contextmanager
    def take(self, size: int) -> Iterator[memoryview]:
        """A buffer's first ``size`` bytes, for the caller alone until the block ends."""
        with self._lock:
            buffer = self._free.pop() if self._free else None
        if buffer is None or len(buffer) < size:
            buffer = mmap.mmap(-1, size)
        view = memoryview(buffer)[:size]
        try:
            yield view
        finally:
            view.release()
            with self._lock:
                self._free.append(buffer)


_STAGING = _StagingBuffers()


def _write_items_direct(
    fd: int, tensors: Sequence[torch.Tensor], sync: bool
) -> tuple[list[tuple[int, int]], FileRecord]:
    """The file's bytes copied through one staging buffer, written in ``O_DIRECT`` chunks.

    Each piece is hashed in the buffer right after it is copied there (in the core's cache).
    The last chunk is padded with zeros to ``DIRECT_ALIGN`` and the file then cut to its
    length; no page cache is filled, so a save runs at the disk's pace whatever the memory
    the kernel must otherwise find for it first (docs/benchmarks.md, session 11).
    """
    places: list[tuple[int, int]] = []
    ranges: list[tuple[int, int, str]] = []
    position = 0  # the file offset after the last item
    chunk = DIRECT_CHUNK
    with _STAGING.take(chunk) as buffer:
        filled = 0  # bytes of the buffer not written yet
        flushed = 0  # the file offset of buffer[0]

        def put(data: memoryview, digest: xxhash.xxh3_128) -> None:
            nonlocal filled, flushed
            while data:
                count = min(len(data), chunk - filled, _PIECE_BYTES)
                copy = buffer[filled : filled + count]
                copy[:] = data[:count]
                digest.update(copy)
                copy.release()
                filled += count
                data = data[count:]
                if filled == chunk:
                    _write_all(fd, buffer, flushed)
                    flushed += chunk
                    filled = 0

        for start, padding, view in _layout(tensors):
            position = start + len(padding) + len(view)
            places.append((start + len(padding), len(view)))
            digest = xxhash.xxh3_128()
            put(memoryview(padding), digest)
            put(view, digest)
            ranges.append((start, position - start, digest.hexdigest()))
        if filled:
            tail = filled + (-filled) % DIRECT_ALIGN
            buffer[filled:tail] = bytes(tail - filled)
            _write_all(fd, buffer[:tail], flushed)
    os.ftruncate(fd, position)
    if sync:
        os.fsync(fd)
    return places, record_of_ranges(ranges, position)


def _write_items(
    fd: int, tensors: Sequence[torch.Tensor], sync: bool
) -> tuple[list[tuple[int, int]], FileRecord]:
    places: list[tuple[int, int]] = []
    ranges: list[tuple[int, int, str]] = []
    gathered = bytearray()  # small items (and paddings) not written yet
    gathered_at = 0  # the file offset of gathered[0]
    position = 0  # the file offset after the last item
    written_back = 0

    def flush_gathered() -> None:
        nonlocal gathered, gathered_at
        if gathered:
            _write_all(fd, memoryview(gathered), gathered_at)
        gathered_at += len(gathered)
        gathered = bytearray()

    for start, padding, view in _layout(tensors):
        offset = start + len(padding)
        position = offset + len(view)
        places.append((offset, len(view)))
        if len(view) < _GATHER_BYTES:
            gathered += padding
            gathered += view
            item = memoryview(gathered)[start - gathered_at :]
            ranges.append((start, position - start, _hash(item)))
            item.release()
            if len(gathered) >= _GATHER_BYTES:
                flush_gathered()
            continue
        gathered += padding
        flush_gathered()
        # A large item, piece by piece: each is hashed, then written while it is still in
        # the core's cache (hashing it from memory in a second thread, as before, made the
        # save memory-bound: 1.5x the same save without digests).
        digest = xxhash.xxh3_128(padding)
        for begin in range(0, len(view), _PIECE_BYTES):
            piece = view[begin : begin + _PIECE_BYTES]
            digest.update(piece)
            _write_all(fd, piece, offset + begin)
            if offset + begin + len(piece) - written_back >= _WRITEBACK_BYTES:
                start_writeback(fd, written_back, offset + begin + len(piece) - written_back)
                written_back = offset + begin + len(piece)
        gathered_at = position
        ranges.append((start, position - start, digest.hexdigest()))
    flush_gathered()
    if sync:
        os.fsync(fd)
    return places, record_of_ranges(ranges, position)


@dataclass
class Want:
    """One item a reader needs from a file.

    Attributes:
        offset: Where the item's range starts in the file (its padding included).
        length: The range's length.
        digest: The range's recorded XXH3-128 digest (None: not verified).
        skip: Bytes of padding at the range's start (read and hashed, not delivered).
        into: Where the item's bytes go as they are read (the destination tensor's bytes),
            or None to read them into a new buffer.
        done: Called with the item's bytes once all are read and verified.
    """

    offset: int
    length: int
    digest: str | None
    skip: int
    into: memoryview | None
    done: Callable[[memoryview], None]

    def destination(self, path: Path) -> memoryview:
        """Where the item's bytes go: ``into``, or a new buffer of their length."""
        length = self.length - self.skip
        target = self.into if self.into is not None else memoryview(bytearray(length))
        if len(target) != length:
            raise CheckpointError(f"{path}: an item of {length} bytes read into {len(target)}")
        return target

    def deliver(self, path: Path, digest: xxhash.xxh3_128, target: memoryview) -> None:
        """Hand ``target`` to ``done`` once the range's ``digest`` matches the recorded one."""
        if self.digest is not None and digest.hexdigest() != self.digest:
            end = self.offset + self.length
            raise ContentMismatch(
                f"{path}: content differs from its checksum (bytes {self.offset}..{end})"
            )
        self.done(target)


def read_wanted(path: Path, size: int, wants: list[Want], *, direct: bool = False) -> None:
    """Read ``wants`` from ``path`` in file order, verifying each range as its bytes arrive.

    Each piece is hashed right after it is read, with no second read from the disk; a
    range's ``done`` runs only once its digest matched.

    Args:
        path: The data file.
        size: Its length as the manifest records it.
        wants: The items to read.
        direct: Read with ``O_DIRECT`` into a staging buffer, then hash and copy each piece
            to its destination (no page cache filled), where the file system takes it;
            otherwise, or where it refuses, buffered reads straight into the destinations.

    Raises:
        ContentMismatch: If the file's size is not ``size`` or a range's bytes differ from
            its digest.
        CheckpointError: If ``path`` is a link or not a regular file.
    """
    wants = sorted(wants, key=lambda want: want.offset)
    with open_regular(path) as file:
        fd = file.fileno()
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ContentMismatch(f"{path}: has {actual} bytes, the manifest records {size}")
        for want in wants:
            if want.offset + want.length > size:
                raise ContentMismatch(f"{path}: an item runs past the end of the file")
        if direct and _set_direct(fd, on=True):
            try:
                _read_direct(fd, path, wants)
                return
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                _set_direct(fd, on=False)  # refused midway: read it all again, buffered
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for want in wants:
            _read_one(fd, path, want)


def _read_direct(fd: int, path: Path, wants: list[Want]) -> None:
    """``wants`` (in file order) read in aligned ``O_DIRECT`` windows of one staging buffer.

    Wants less than ``_DIRECT_GAP_BYTES`` apart are read as one stream (the bytes between
    them read and dropped); each window is at most the buffer's size and ends at a block
    boundary past the stream's end. Within a window each want's bytes are hashed and copied
    to their destination by 2 MB pieces (the copy reads what the hash just brought to cache).
    """
    stream_ends = [0] * len(wants)
    end = 0
    for number in reversed(range(len(wants))):
        want = wants[number]
        if (
            number + 1 == len(wants)
            or wants[number + 1].offset - (want.offset + want.length) > _DIRECT_GAP_BYTES
        ):
            end = want.offset + want.length
        stream_ends[number] = end
    with _STAGING.take(_DIRECT_READ_BYTES) as buffer:
        window, held = 0, 0  # the file offset of buffer[0], the bytes the buffer holds

        def bytes_at(position: int, stop: int, stream_end: int) -> memoryview:
            """File bytes from ``position`` (at most up to ``stop``), read in if need be."""
            nonlocal window, held
            if not window <= position < window + held:
                window = position - position % DIRECT_ALIGN
                want_bytes = stream_end - window
                length = min(len(buffer), want_bytes + (-want_bytes) % DIRECT_ALIGN)
                held = 0
                while held < length:
                    count = os.preadv(fd, [buffer[held:length]], window + held)
                    if count == 0:
                        break
                    held += count
                if position >= window + held:
                    raise ContentMismatch(f"{path}: ends before byte {stop}")
            return buffer[position - window : min(stop, window + held) - window]

        for want, stream_end in zip(wants, stream_ends, strict=True):
            target = want.destination(path)
            digest = xxhash.xxh3_128()
            position, stop = want.offset, want.offset + want.length
            data_start = want.offset + want.skip
            while position < stop:
                piece = bytes_at(position, min(stop, position + _PIECE_BYTES), stream_end)
                digest.update(piece)
                if position + len(piece) > data_start:
                    begin = max(position, data_start)
                    target[begin - data_start : position + len(piece) - data_start] = piece[
                        begin - position :
                    ]
                position += len(piece)
                piece.release()
            want.deliver(path, digest, target)


def _read_one(fd: int, path: Path, want: Want) -> None:
    target = want.destination(path)
    length = len(target)
    digest = xxhash.xxh3_128()
    padding = bytearray(want.skip)
    _read_exact(fd, memoryview(padding), want.offset, path)
    digest.update(padding)
    for begin in range(0, length, _READ_PIECE_BYTES):
        piece = target[begin : begin + _READ_PIECE_BYTES]
        _read_exact(fd, piece, want.offset + want.skip + begin, path)
        digest.update(piece)
    want.deliver(path, digest, target)


def _read_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    while view:
        count = os.preadv(fd, [view], offset)
        if count == 0:
            raise ContentMismatch(f"{path}: ends before byte {offset + len(view)}")
        view, offset = view[count:], offset + count
