"""DCP sharded saves, synchronous or asynchronous, that never overlap, checksummed and unpickled.

Measured on torch 2.13 (see TORCH_NOTES.md): a thread-mode async save on the default group
while training runs collectives on it aborts both processes, and a second save, sync or
async, started while one is in flight deadlocks. So async saves run on a dedicated gloo
group, and every save first waits for the one in flight.

Step checkpoints are written by :class:`ChecksummedWriter` (raw tensor files, every item
hashed as it is written, metadata as JSON rather than DCP's pickled ``.metadata``) and read
back by :class:`SafeReader`, which parses that JSON strictly, reads tensor bytes only and
verifies them as they arrive. DCP still plans both: which rank writes which chunk, and which
stored chunks each rank reads (resharding to another world size).
"""

import contextlib
import gc
import io
import json
import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from tunelab.checkpoint import _dcp_json
from tunelab.checkpoint._dcp_json import StorageInfo
from tunelab.checkpoint._tensor_files import (
    ContentMismatch,
    Want,
    read_wanted,
    tensor_bytes,
    write_tensor_file,
)
from tunelab.distributed import collective_timeout
from tunelab.errors import CheckpointError, TunelabError, first_line
from tunelab.formats.integrity import FileRecord, open_regular, record_of
from tunelab.formats.layout import write_atomic

FileRecords = dict[str, FileRecord]
WriterFactory = Callable[[Path], StorageWriter]
# Write results under this prefix carry a rank's file checksums to the coordinator's finish
# step, through the gather DCP does anyway (no extra collective).
_RECORD_PREFIX = "\0tunelab-file-record/"
WRITE_THREADS = 2
"""Files each rank writes in parallel in a step save (see docs/benchmarks.md, checkpoint I/O)."""
DIRECT_WRITES = True
"""Step saves write their data files with ``O_DIRECT`` (no page cache filled; on this VM's disk
0.68-0.87x a buffered write + fsync of the same bytes in 7 runs at 2 GB, 1.13x a raw
``O_DIRECT`` write, where buffered saves took 1.27-1.33x: docs/benchmarks.md). Files whose
system refuses it are written buffered, the same bytes."""
READ_THREADS = 2
"""Files each rank reads in parallel on resume."""
DIRECT_READS = True
"""Resumes read data files with ``O_DIRECT`` into a staging buffer, each piece hashed and copied
to its shard (no page cache filled; on this VM's disk loads of 3.7-5.0 s at 2 GB, 0.90-0.93x a
buffered cold read and 0.97-1.04x a raw ``O_DIRECT`` read, where buffered loads took 4.0-6.2 s:
docs/benchmarks.md). Files whose system refuses it are read buffered, into the shards."""
PREFETCH_BYTES = 64 << 20
"""Bytes of each of its files a rank asks the disk for while the load plans (``prefetch``)."""
_MIN_FILE_BYTES = 64 << 20  # a rank's state is split into files of at least this size


class ChecksummedWriter(dcp.FileSystemWriter):
    """DCP storage writer of step checkpoints: raw tensor files, checksummed, JSON metadata.

    DCP plans the save (which rank writes which chunk); each rank then writes its items'
    bytes into ``threads`` files in parallel (``_tensor_files``: raw bytes at aligned offsets,
    hashed while written, with ``O_DIRECT`` from a staging buffer where the file system takes
    it, one ``fsync`` per file).
    After a save, the coordinator's :attr:`file_records` holds every rank's files and
    ``.metadata.json`` with their checksums: what the step's manifest lists.

    Args:
        path: The checkpoint folder.
        sync_files: fsync every file before the save completes.
        threads: Files written in parallel by each rank (items split between them by size).
        direct: Write the data files with ``O_DIRECT`` where the file system takes it
            (``DIRECT_WRITES``); False: buffered writes.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        sync_files: bool = True,
        threads: int = WRITE_THREADS,
        direct: bool | None = None,
    ) -> None:
        super().__init__(path, sync_files=sync_files, thread_count=threads)
        self.direct = DIRECT_WRITES if direct is None else direct
        self.file_records: FileRecords = {}

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        """Write this rank's items, then add its file checksums to the write results."""
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise CheckpointError(f"{item.index.fqn!r} is not a tensor; only tensors are saved")
        prefix = plan.storage_data.prefix
        buckets = _split_by_size(list(plan.items), self.thread_count)
        jobs = [(f"{prefix}{n}{DEFAULT_SUFFIX}", bucket) for n, bucket in enumerate(buckets)]

        def write(name: str, items: list[WriteItem]) -> list[WriteResult]:
            """One file's items, and its checksum record (under ``_RECORD_PREFIX``)."""
            tensors = [_cpu(planner.resolve_data(item)) for item in items]
            places, record = write_tensor_file(
                Path(self.path) / name, tensors, sync=self.sync_files, direct=self.direct
            )
            written = [
                WriteResult(
                    index=item.index,
                    size_in_bytes=length,
                    storage_data=StorageInfo(name, offset, length),
                )
                for item, (offset, length) in zip(items, places, strict=True)
            ]
            record_index = MetadataIndex(_RECORD_PREFIX + name)
            return [*written, WriteResult(index=record_index, size_in_bytes=0, storage_data=record)]

        with ThreadPoolExecutor(max(1, len(jobs))) as pool:
            results = [
                result for file in pool.map(lambda job: write(*job), jobs) for result in file
            ]
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``.metadata.json`` atomically and collect every rank's file checksums."""
        records: FileRecords = {}
        storage_data = {}
        for rank_results in results:
            for result in rank_results:
                if result.index.fqn.startswith(_RECORD_PREFIX):
                    records[result.index.fqn.removeprefix(_RECORD_PREFIX)] = result.storage_data
                else:
                    storage_data[result.index] = result.storage_data
        payload = json.dumps(_dcp_json.to_json(metadata, storage_data)).encode()
        write_atomic(Path(self.path) / _dcp_json.METADATA_JSON_NAME, payload, sync=self.sync_files)
        records[_dcp_json.METADATA_JSON_NAME] = record_of(payload)
        self.file_records = records


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


def _split_by_size(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """``items`` in groups of about equal bytes, largest first, one file each.

    At most ``bins`` groups, and no more than one per ``_MIN_FILE_BYTES``: a small state
    (an adapter, a tiny model) stays one file per rank.
    """

    def size(item: WriteItem) -> int:
        data = item.tensor_data
        return math.prod(data.size) * data.properties.dtype.itemsize if data else 0

    total = sum(size(item) for item in items)
    groups: list[list[WriteItem]] = [[] for _ in range(max(1, min(bins, total // _MIN_FILE_BYTES)))]
    loads = [0] * len(groups)
    for item in sorted(items, key=size, reverse=True):
        smallest = loads.index(min(loads))
        groups[smallest].append(item)
        loads[smallest] += size(item)
    return [group for group in groups if group] or [[]]


class SafeReader(dcp.FileSystemReader):
    """DCP storage reader of step checkpoints: JSON metadata only, raw tensor bytes only.

    Reads ``.metadata.json`` (never a pickle). Each rank reads the items its shards need, file
    by file in ``threads`` parallel threads, each run of items sequentially in large reads
    straight into the destination tensors, and verifies each item's range against the
    manifest's digest as the bytes arrive (no second read); :attr:`verified` names the
    ranges it checked. Checkpoints of tunelab before raw files (``torch.save`` records) are
    read through DCP's own reader with ``torch.load(weights_only=True)``, unverified here
    (the client verifies them whole first).

    Args:
        path: The checkpoint folder.
        records: The manifest's file records (None: read without verifying).
        threads: Files read in parallel by each rank.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        records: FileRecords | None = None,
        *,
        threads: int = READ_THREADS,
    ) -> None:
        super().__init__(path)
        self._records = records
        self._threads = threads
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.Size, torch.dtype]] = {}
        self._metadata: Metadata | None = None
        self.raw_records = True
        """Whether the data files hold raw bytes (False: ``torch.save`` records)."""
        self.verified: set[tuple[str, int]] = set()
        """``(file, range offset)`` of every range this rank read and verified."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Parse and validate the JSON metadata (once per reader; later calls reuse it).

        Raises:
            CheckpointError: If it is missing, not JSON, or not what tunelab writes.
        """
        if self._metadata is not None:
            return self._metadata
        path = Path(self.path) / _dcp_json.METADATA_JSON_NAME
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing (not a tunelab step checkpoint)") from None
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{path}: unreadable checkpoint metadata ({error})") from None
        # Thousands of small objects that all live on: a garbage collection triggered midway
        # walks every object of the trainer process (0.15 s of a 0.2 s parse measured at 2 GB).
        with paused_garbage_collection():
            metadata = _dcp_json.from_json(data, str(path))
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        self.raw_records = _dcp_json.holds_raw_records(data)
        self._chunks = {
            (fqn, tuple(chunk.offsets)): (chunk.sizes, entry.properties.dtype)
            for fqn, entry in metadata.state_dict_metadata.items()
            for chunk in entry.chunks  # type: ignore[union-attr]
        }
        self._metadata = metadata
        return metadata

    def data_files(self) -> set[str]:
        """The files the metadata's items are in (raw files: verified while loading)."""
        return {info.relative_path for info in self.read_metadata().storage_data.values()}

    def files_to_prefetch(self, rank: int, world_size: int) -> list[str]:
        """The data files ``rank`` will read whole: the ones it wrote, on the same world size.

        A step checkpoint's data files are named by the rank that wrote them
        (``__<rank>_<n>.distcp``). A resume on the world size that saved shards every tensor
        as the save did, so each rank reads exactly its own files, each from its start. On
        another world size the chunks a rank needs are only known once the load is planned:
        nothing is named.
        """
        if not self.raw_records:
            return []
        files = self.data_files()
        writers = {name.split("_")[2] for name in files if name.startswith("__")}
        if len(writers) != world_size:
            return []
        return sorted(name for name in files if name.startswith(f"__{rank}_"))

    def prefetch(self, rank: int, world_size: int) -> threading.Thread | None:
        """Start the disk reading the head of this rank's data files while the load plans.

        Planning the load (the state dict, DCP's local and global plans) takes 0.1-0.2 s at
        2 GB, in which the disk would idle. The first ``PREFETCH_BYTES`` of each file in
        :meth:`files_to_prefetch` are asked of the kernel (``posix_fadvise(WILLNEED)``, from a
        background thread: the call returns once the reads are queued), and the load's reading
        threads find them in the page cache. A hint only: each byte still comes from the disk
        once and is verified as the load reads it; nothing is asked when no file is named or
        the platform has no ``posix_fadvise``, nor with ``DIRECT_READS`` (direct reads do not
        look in the page cache: the head would come from the disk twice).

        Returns:
            The thread queueing the reads (None when nothing is prefetched).
        """
        mine = self.files_to_prefetch(rank, world_size)
        if not mine or not hasattr(os, "posix_fadvise") or DIRECT_READS:
            return None

        def queue_reads() -> None:
            for name in mine:
                try:
                    with open_regular(Path(self.path) / name) as file:
                        os.posix_fadvise(file.fileno(), 0, PREFETCH_BYTES, os.POSIX_FADV_WILLNEED)
                except (OSError, CheckpointError):  # the load itself reports what is wrong
                    return

        thread = threading.Thread(target=queue_reads, name="tunelab-prefetch", daemon=True)
        thread.start()
        return thread

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """Read this rank's items (raw files: verified as they arrive)."""
        if not self.raw_records:
            return super().read_data(plan, planner)
        per_file: dict[str, dict[int, list[ReadItem]]] = {}
        for request in plan.items:
            info = self.storage_data[request.storage_index]
            per_file.setdefault(info.relative_path, {}).setdefault(info.offset, []).append(request)
        jobs = []
        for name, items in sorted(per_file.items()):
            path = Path(self.path) / name
            record = self._records.get(name) if self._records is not None else None
            if self._records is not None and record is None:
                raise ContentMismatch(f"{path}: not listed in the manifest")
            # A chunk's range is the one ending where the chunk ends (its padding before it).
            ends = None if record is None else {o + n: (o, n, d) for o, n, d in record["ranges"]}
            wants = [self._want(path, requests, planner, ends) for requests in items.values()]
            size = record["size"] if record else os.stat(path).st_size
            jobs.append((path, size, wants))
        with ThreadPoolExecutor(max(1, min(self._threads, len(jobs)))) as pool:
            list(pool.map(lambda job: read_wanted(*job, direct=DIRECT_READS), jobs))
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _want(
        self,
        path: Path,
        requests: list[ReadItem],
        planner: LoadPlanner,
        ends: dict[int, tuple[int, int, str]] | None,
    ) -> Want:
        """What to read for one stored item, and where its bytes go.

        ``ends``: the file's checksummed ranges by where they end (None: not verified).
        """
        index = requests[0].storage_index
        info = self.storage_data[index]
        sizes, dtype = self._chunks.get((index.fqn, tuple(index.offset or ())), (None, None))
        if sizes is None or info.length != math.prod(sizes) * dtype.itemsize:
            raise CheckpointError(
                f"{path}: item {index.fqn!r} is {info.length} bytes, which is not the size "
                "its metadata gives"
            )
        start, length, digest = info.offset, info.length, None
        if ends is not None and info.length > 0:  # an empty item has no bytes to verify
            found = ends.get(info.offset + info.length)
            if found is None or not found[0] <= info.offset:
                raise ContentMismatch(f"{path}: no checksummed range holds item {index.fqn!r}")
            start, length, digest = found
        # The common case (a resume on the world size that saved): the stored chunk is the
        # whole destination shard, whose memory takes the bytes as they are read.
        into, whole = None, None
        if len(requests) == 1 and _covers(requests[0], sizes):
            target = planner.resolve_tensor(requests[0]).detach()
            if target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype:
                into, whole = tensor_bytes(target), target

        def done(data: memoryview) -> None:
            if whole is not None:
                planner.commit_tensor(requests[0], whole)
            else:
                stored = (
                    torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(sizes)
                    if len(data)
                    else torch.empty(sizes, dtype=dtype)
                )
                for request in requests:
                    source = _narrow(stored, request.storage_offsets, request.lengths)
                    target = planner.resolve_tensor(request).detach()
                    if target.size() != source.size():
                        raise CheckpointError(
                            f"{request.storage_index.fqn!r}: stored {list(source.size())}, "
                            f"the model needs {list(target.size())}"
                        )
                    target.copy_(source)
                    planner.commit_tensor(request, target)
            if digest is not None:
                self.verified.add((path.name, start))

        return Want(start, length, digest, info.offset - start, into, done)


@contextlib.contextmanager
def paused_garbage_collection() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block (restored as it was after).

    A load creates tens of thousands of small objects (DCP's read items and plans, the
    metadata); each collection they trigger walks every object of the trainer process (the
    model's modules, torch's and the data libraries' state). At 2 GB on 2 ranks, pausing it
    for the resume took the load from 4.43 s to 4.05 s (median of 4 alternating runs).
    Garbage made meanwhile is collected by the next automatic collection.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The block of ``tensor`` at ``offsets`` of ``lengths`` (a view)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


def _covers(request: ReadItem, sizes: torch.Size) -> bool:
    """Whether ``request`` reads the whole stored chunk."""
    return all(offset == 0 for offset in request.storage_offsets) and tuple(
        request.lengths
    ) == tuple(sizes)


class _TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, refusing byte items (DCP would ``torch.load`` them unrestricted)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Refuse: step checkpoints hold tensors only."""
        raise CheckpointError(
            f"{read_item.dest_index.fqn!r} is not tensor data; refusing to load it"
        )


def default_writer(path: Path) -> StorageWriter:
    """A :class:`ChecksummedWriter` that fsyncs every file before the save completes."""
    return ChecksummedWriter(path, sync_files=True)


def as_checkpoint_error(error: BaseException, path: Path, doing: str) -> BaseException:
    """Turn a failure inside a (DCP) save into one line naming the folder and the OS error.

    A ``TunelabError`` found in the failure is returned as it is; an ``OSError`` becomes a
    ``CheckpointError`` ``"{doing} {path} failed: {file}: {reason}"``; anything else is
    returned unchanged (a bug keeps its traceback).
    """
    causes = [error]
    if isinstance(error, CheckpointException):
        causes += [failure for failure, _ in error.failures.values()]
    for cause in causes:
        while cause is not None:
            if isinstance(cause, TunelabError):
                return cause
            if isinstance(cause, OSError):
                reason = cause.strerror or str(cause)
                where = f"{cause.filename}: " if cause.filename else ""
                return CheckpointError(f"{doing} {path} failed: {where}{reason}")
            cause = cause.__cause__ or cause.__context__
    return error


class DCPSaver:
    """Runs DCP saves one at a time, in the background when asked to.

    Args:
        enable_async: Return from :meth:`save` while the state is staged to CPU (see
            :meth:`wait_for_staging`) and write it in a background thread.
        writer_factory: Builds the storage writer for a checkpoint folder
            (``default_writer`` when None).
    """

    def __init__(self, *, enable_async: bool, writer_factory: WriterFactory | None = None):
        self._distributed = dist.is_initialized()
        self.enable_async = enable_async and self._distributed
        self._writer_factory = writer_factory or default_writer
        # Its own gloo group, so background writes never interleave with training collectives.
        # The run's collective timeout too: a hung peer fails a checkpoint collective as well.
        self._group = (
            dist.new_group(backend="gloo", timeout=collective_timeout())
            if self._distributed
            else None
        )
        self._stager = (
            # Staging options measured to work on CPU: no pinned or shared memory, no
            # non-blocking copies, asynchronous staging.
            DefaultStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=False,
                )
            )
            if self.enable_async
            else None
        )
        self._pending: Future | None = None
        self._staging: Future | None = None
        self._on_done: Callable[[], None] | None = None
        self._path = Path()
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The checkpoint's own gloo group (None without a default group)."""
        return self._group

    @property
    def in_flight(self) -> bool:
        """Whether a background write has not been waited for yet."""
        return self._pending is not None

    def save(
        self,
        state_dict: dict[str, Any],
        path: Path,
        on_done: Callable[[FileRecords], None],
        *,
        blocking: bool = False,
    ) -> None:
        """Save ``state_dict`` to ``path`` after waiting for any save in flight.

        Args:
            state_dict: Tensors and DTensors keyed by FQN. Staged copies are written; with
                async saves the caller may change the live tensors once
                :meth:`wait_for_staging` returns.
            path: The checkpoint folder.
            on_done: Called once every rank's files are durable, with the checksum records of
                every file (on the coordinator; empty elsewhere): it commits the checkpoint.
            blocking: Write synchronously even when async saves are enabled.
        """
        self.wait()
        os.makedirs(path, exist_ok=True)
        writer = self._writer_factory(path)
        if blocking or not self.enable_async:
            try:
                dcp.save(state_dict, storage_writer=writer, process_group=self._group)
            except (Exception, CheckpointException) as error:  # DCP's is a BaseException
                raise as_checkpoint_error(error, path, "writing checkpoint") from error
            on_done(getattr(writer, "file_records", {}))
            return
        response = dcp.async_save(
            state_dict, storage_writer=writer, process_group=self._group, async_stager=self._stager
        )
        if isinstance(response, AsyncSaveResponse):
            # Staging (a copy to CPU buffers) finishes in the background while the next
            # forward and backward run, which only read the parameters; whatever changes them
            # (the optimizer step, an in-place edit) first calls wait_for_staging().
            self._staging = response.staging_completion
            future = response.upload_completion
        else:
            future = response
        self._pending, self._error = future, None
        self._on_done = lambda: on_done(getattr(writer, "file_records", {}))
        self._path = path
        future.add_done_callback(self._finish)

    def _finish(self, future: Future) -> None:
        # Runs in the writer thread as soon as the upload completes (so a checkpoint is
        # committed promptly), or from wait(); the lock makes on_done run exactly once.
        with self._lock:
            if self._on_done is None or future is not self._pending:
                return
            on_done, self._on_done = self._on_done, None
            try:
                future.result()
                on_done()
            except BaseException as error:  # noqa: BLE001 - re-raised by wait()
                self._error = as_checkpoint_error(error, self._path, "writing checkpoint")

    def wait_for_staging(self) -> None:
        """Block until the save in flight has copied the state it writes."""
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.result()

    def wait(self) -> None:
        """Block until the save in flight is written and committed; re-raise its error."""
        self.wait_for_staging()
        future = self._pending
        if future is None:
            return
        with contextlib.suppress(Exception, CheckpointException):
            future.result()  # Its error, if any, is recorded by _finish and raised below.
        self._finish(future)
        self._pending = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Wait for the save in flight and release the stager and the process group."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._group is not None:
                # Every rank must be done with the group's last collective before any rank
                # tears its gloo connections down, or a peer still finishing one aborts.
                dist.barrier(group=self._group)
                dist.destroy_process_group(self._group)
                self._group = None


def load(
    state_dict: dict[str, Any],
    path: Path,
    records: FileRecords | None = None,
    *,
    reader: SafeReader | None = None,
) -> set[tuple[str, int]]:
    """Load a step checkpoint into ``state_dict`` in place, resharding to this world size.

    Reads only ``.metadata.json`` (strictly parsed) and raw tensor bytes (checkpoints of
    tunelab before raw files: tensor records through ``torch.load(weights_only=True)``);
    nothing is unpickled without restriction.

    Args:
        state_dict: Tensors and DTensors to fill, keyed by FQN.
        path: The step checkpoint.
        records: The manifest's file records: every range read is verified as it arrives.
            None reads without verifying.
        reader: A reader of ``path`` with ``records`` whose metadata is parsed already.

    Returns:
        ``(file, range offset)`` of every range this rank read and verified; the other ranks'
        are theirs (the caller verifies what no rank read).

    Raises:
        ContentMismatch: If bytes read differ from their checksum (on every rank: DCP
            gathers each rank's failure). ``state_dict`` may then hold some of them.
        CheckpointError: If the metadata is not what tunelab writes or a record cannot be
            loaded (a pickle that is not plain tensor data is refused, never run).
    """
    reader = reader or SafeReader(path, records)
    reader.read_metadata()  # Its errors, raised here, are one line (DCP wraps them).
    try:
        with paused_garbage_collection():
            dcp.load(state_dict, storage_reader=reader, planner=_TensorOnlyLoadPlanner())
    except CheckpointException as error:
        # The lowest rank's failure first: every rank raises the same one.
        failures = [error.failures[rank][0] for rank in sorted(error.failures)]
        for failure in failures:
            if isinstance(failure, CheckpointError):
                raise failure from error
        first = first_line(failures[0] if failures else error)
        raise CheckpointError(f"{path}: cannot load ({first})") from error
    return reader.verified


def saved_keys(path: Path) -> set[str]:
    """Return the FQNs a step checkpoint holds (reads only its JSON metadata)."""
    return set(SafeReader(path).read_metadata().state_dict_metadata)
