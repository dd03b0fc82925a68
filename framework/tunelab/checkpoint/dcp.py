"""DCP sharded saves, synchronous or asynchronous, that never overlap.

Measured on torch 2.13 (see TORCH_NOTES.md): a thread-mode async save on the default group
while training runs collectives on it aborts both processes, and a second save, sync or
async, started while one is in flight deadlocks. So async saves run on a dedicated gloo
group, and every save first waits for the one in flight.
"""

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.storage import StorageWriter

WriterFactory = Callable[[Path], StorageWriter]


def default_writer(path: Path) -> StorageWriter:
    """A ``FileSystemWriter`` that fsyncs every file before the save completes."""
    return dcp.FileSystemWriter(path, sync_files=True)


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
        self._group = dist.new_group(backend="gloo") if self._distributed else None
        self._stager = (
            # Staging options measured to work on CPU: no pinned or shared memory, no
            # non-blocking copies, asynchronous staging.
            DefaultStager(StagingOptions(False, False, True, False)) if self.enable_async else None
        )
        self._pending: Future | None = None
        self._staging: Future | None = None
        self._on_done: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a background write has not been waited for yet."""
        return self._pending is not None

    def save(
        self,
        state_dict: dict[str, Any],
        path: Path,
        on_done: Callable[[], None],
        *,
        blocking: bool = False,
    ) -> None:
        """Save ``state_dict`` to ``path`` after waiting for any save in flight.

        Args:
            state_dict: Tensors and DTensors keyed by FQN. Staged copies are written; with
                async saves the caller may change the live tensors once
                :meth:`wait_for_staging` returns.
            path: The checkpoint folder.
            on_done: Called once every rank's files are durable (commits the checkpoint).
            blocking: Write synchronously even when async saves are enabled.
        """
        self.wait()
        os.makedirs(path, exist_ok=True)
        writer = self._writer_factory(path)
        if blocking or not self.enable_async:
            dcp.save(state_dict, storage_writer=writer, process_group=self._group)
            on_done()
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
        self._pending, self._on_done, self._error = future, on_done, None
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
                self._error = error

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
        future.result()
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
    """Load a DCP checkpoint into ``state_dict`` in place, resharding to this world size."""
    dcp.load(state_dict, checkpoint_id=path)


def saved_keys(path: Path) -> set[str]:
    """Return the FQNs a DCP checkpoint holds (reads only its metadata)."""
    return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
