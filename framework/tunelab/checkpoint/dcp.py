"""DCP sharded saves, synchronous or asynchronous, that never overlap, checksummed and unpickled.

Measured on torch 2.13 (see TORCH_NOTES.md): a thread-mode async save on the default group
while training runs collectives on it aborts both processes, and a second save, sync or
async, started while one is in flight deadlocks. So async saves run on a dedicated gloo
group, and every save first waits for the one in flight.

Step checkpoints are written by :class:`ChecksummedWriter` (every file hashed as it is
written, metadata as JSON rather than DCP's pickled ``.metadata``) and read back by
:class:`SafeReader`, which parses that JSON strictly and loads tensor data only.
"""

import contextlib
import io
import json
import os
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from tunelab.checkpoint import _dcp_json
from tunelab.checkpoint.integrity import FileRecord, HashingWriter, RecordBook, record_of
from tunelab.checkpoint.layout import write_atomic
from tunelab.distributed import collective_timeout
from tunelab.errors import CheckpointError, TunelabError, first_line

FileRecords = dict[str, FileRecord]
WriterFactory = Callable[[Path], StorageWriter]
# Write results under this prefix carry a rank's file checksums to the coordinator's finish
# step, through the gather DCP does anyway (no extra collective).
_RECORD_PREFIX = "\0tunelab-file-record/"


class _HashingFileSystem(FileSystem):
    """DCP's local filesystem, with every file opened for writing hashed as it is written."""

    def __init__(self, book: RecordBook) -> None:
        super().__init__()
        self.book = book

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        """Open ``path``; a stream opened with ``"wb"`` records its checksum when closed."""
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream, ThreadPoolExecutor(1) as hasher:
            hashing = HashingWriter(stream, hasher)
            try:
                yield hashing
            except RuntimeError as error:
                # torch.save's zip writer swallows the OSError its write raised (a full disk)
                # and fails later with "unexpected pos ...": the OSError is the cause to report.
                if hashing.failure is not None:
                    raise hashing.failure from error
                raise
            self.book.add(Path(path).name, hashing.record())


class ChecksummedWriter(dcp.FileSystemWriter):
    """``FileSystemWriter`` that checksums every file and writes its metadata as JSON.

    After a save, the coordinator's :attr:`file_records` holds every rank's files and
    ``.metadata.json`` with their checksums: what the step's manifest lists.

    Args:
        path: The checkpoint folder.
        sync_files: fsync every file before the save completes.
    """

    def __init__(self, path: str | os.PathLike, *, sync_files: bool = True) -> None:
        super().__init__(path, sync_files=sync_files)
        self._book = RecordBook()
        self.fs = _HashingFileSystem(self._book)
        self.file_records: FileRecords = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        """Write this rank's items, then add its file checksums to the write results."""
        future = super().write_data(plan, planner)
        results = list(future.wait())
        results += [
            WriteResult(
                index=MetadataIndex(_RECORD_PREFIX + name), size_in_bytes=0, storage_data=record
            )
            for name, record in self._book.records().items()
        ]
        done: Any = type(future)()
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


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` that reads ``.metadata.json`` (never a pickle) and tensors only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Parse and validate the JSON metadata.

        Raises:
            CheckpointError: If it is missing, not JSON, or not what tunelab writes.
        """
        path = Path(self.path) / _dcp_json.METADATA_JSON_NAME
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing (not a tunelab step checkpoint)") from None
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{path}: unreadable checkpoint metadata ({error})") from None
        metadata = _dcp_json.from_json(data, str(path))
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata


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


def load(state_dict: dict[str, Any], path: Path) -> None:
    """Load a step checkpoint into ``state_dict`` in place, resharding to this world size.

    Reads only ``.metadata.json`` (strictly parsed) and tensor records (``torch.load`` with
    ``weights_only=True``, inside DCP); nothing is unpickled without restriction.

    Raises:
        CheckpointError: If the metadata is not what tunelab writes or a record cannot be
            loaded (a pickle that is not plain tensor data is refused, never run).
    """
    reader = SafeReader(path)
    reader.read_metadata()  # Its errors, raised here, are one line (DCP wraps them).
    try:
        dcp.load(state_dict, storage_reader=reader, planner=_TensorOnlyLoadPlanner())
    except CheckpointException as error:
        failures = [failure for failure, _ in error.failures.values()]
        for failure in failures:
            if isinstance(failure, CheckpointError):
                raise failure from error
        first = first_line(failures[0] if failures else error)
        raise CheckpointError(f"{path}: cannot load ({first})") from error


def saved_keys(path: Path) -> set[str]:
    """Return the FQNs a step checkpoint holds (reads only its JSON metadata)."""
    return set(SafeReader(path).read_metadata().state_dict_metadata)
