"""Checkpoint directory layout, the commit marker, retention and clean-up.

A step directory counts only once it is committed: after every rank's files are durable,
rank 0 writes ``MANIFEST_NAME`` atomically (temp file, fsync, rename, fsync of the folder),
listing every file of the save with its size and checksums (``tunelab.checkpoint.integrity``).
Resume, retention and every "latest" lookup ignore directories without it, so a crash
mid-save can never leave a half-written checkpoint that looks resumable.
"""

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab._fs import fsync_path
from tunelab.checkpoint.integrity import (
    DIGEST_NAME,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    FileRecord,
    read_manifest_file,
)
from tunelab.errors import CheckpointError

_STEP_PATTERN = re.compile(r"^step_(\d+)$")
# Names tunelab gives files and folders while they are being written (write_atomic's
# ``.{name}.tmp-{pid}``, the export's ``.{name}.partial`` and ``.{name}.old``, the adapter's
# ``.adapter.tmp-{pid}`` / ``.adapter.old-{pid}``). A run that owns the output_dir (it holds
# the lock) removes any it finds at start: they are left by a killed run.
_STALE_PATTERN = re.compile(r"^\..+\.((tmp|old)-[A-Za-z0-9_]+|partial|old)$")


def is_temporary_name(name: str) -> bool:
    """Whether ``name`` is one tunelab gives a file or folder while writing it."""
    return bool(_STALE_PATTERN.match(name))


def step_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Return ``{output_dir}/step_{step}``."""
    return Path(output_dir) / f"step_{step}"


def epoch_dir(output_dir: str | os.PathLike, epoch: int) -> Path:
    """Return ``{output_dir}/epoch_{epoch}``, the Hugging Face export of an epoch."""
    return Path(output_dir) / f"epoch_{epoch}"


def write_atomic(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one.

    Writes a temp file in the same folder, fsyncs it, renames it over ``path`` and fsyncs
    the folder, so the rename itself survives a power loss (``sync=False`` skips both fsyncs:
    atomic for readers, not durable across a power loss).
    """
    temp_path = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temp_path, "wb") as file:
            file.write(data)
            file.flush()
            if sync:
                os.fsync(file.fileno())
        os.replace(temp_path, path)
    except BaseException:
        temp_path.unlink(missing_ok=True)
        raise
    if sync:
        fsync_path(path.parent)


def write_manifest(directory: Path, files: dict[str, FileRecord], **fields: Any) -> dict:
    """Write ``directory``'s manifest atomically: ``fields`` plus the file records.

    For a step directory this is the commit. Returns the manifest as written.
    """
    head = {"manifest_version": MANIFEST_VERSION, **fields, "digest": DIGEST_NAME}
    # One line per file, so the manifest stays readable with many checksum ranges.
    records = ",\n".join(
        f"  {json.dumps(name)}: {json.dumps(record)}" for name, record in sorted(files.items())
    )
    text = json.dumps(head, indent=1)[:-2] + ',\n "files": {\n' + records + "\n }\n}\n"
    write_atomic(directory / MANIFEST_NAME, text.encode())
    return {**head, "files": dict(sorted(files.items()))}


def commit(directory: Path, manifest: dict[str, Any], files: dict[str, FileRecord]) -> dict:
    """Commit a step directory whose files every rank has made durable.

    Args:
        directory: The step directory.
        manifest: Step, epoch, world size, config hash, versions and the rest.
        files: Every file of the save (relative POSIX path) with its checksum record.

    Returns:
        The manifest as written.
    """
    return write_manifest(directory, files, **manifest)


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """Return a step directory's manifest, or None when it is not committed.

    Raises:
        CheckpointError: The manifest exists but is unreadable or has no checksums.
    """
    if not (directory / MANIFEST_NAME).is_file():
        return None
    return read_manifest_file(directory)


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed step directory and its manifest."""

    step: int
    path: Path
    manifest: dict[str, Any]


@dataclass(frozen=True)
class UnreadableCheckpoint:
    """A step directory with a manifest that cannot be read."""

    step: int
    path: Path
    reason: str


def scan_checkpoints(
    output_dir: str | os.PathLike,
) -> tuple[list[CommittedCheckpoint], list[UnreadableCheckpoint]]:
    """Return the committed step directories and those whose manifest is unreadable.

    Both lists are oldest first. Directories without a manifest (in flight, or left by a
    crash) are in neither.
    """
    root = Path(output_dir)
    committed: list[CommittedCheckpoint] = []
    unreadable: list[UnreadableCheckpoint] = []
    if not root.is_dir():
        return committed, unreadable
    for path in root.iterdir():
        match = _STEP_PATTERN.match(path.name)
        if not match or not path.is_dir():
            continue
        step = int(match.group(1))
        try:
            manifest = read_manifest(path)
        except CheckpointError as error:
            unreadable.append(UnreadableCheckpoint(step, path, str(error)))
            continue
        if manifest is not None:
            committed.append(CommittedCheckpoint(step, path, manifest))
    return (
        sorted(committed, key=lambda checkpoint: checkpoint.step),
        sorted(unreadable, key=lambda checkpoint: checkpoint.step),
    )


def committed_checkpoints(output_dir: str | os.PathLike) -> list[CommittedCheckpoint]:
    """Return the committed step directories under ``output_dir``, oldest first.

    Directories without a manifest (in flight, or left by a crash) and those whose manifest
    is unreadable are not listed (``scan_checkpoints`` lists the latter).
    """
    return scan_checkpoints(output_dir)[0]


def check_resume_setting(output_dir: str | os.PathLike, resume: bool | str) -> None:
    """Refuse a ``resume_from_checkpoint`` that cannot do what it says in ``output_dir``.

    Reads manifests only (no torch), so ``tunelab validate`` and ``tunelab run`` say it before
    any process starts, and the recipe says it again at start (the folder may have changed).

    Args:
        output_dir: The run's output folder.
        resume: ``True``, ``False`` or ``"auto"``.

    Raises:
        CheckpointError: ``False`` (a fresh run) into a folder with committed checkpoints, whose
            first save would collide with one; ``True`` into a folder with none.
    """
    committed, unreadable = scan_checkpoints(output_dir)
    existing = sorted((c.step, c.path.name) for c in [*committed, *unreadable])
    if resume is False and existing:
        names = ", ".join(name for _, name in existing[-3:])
        raise CheckpointError(
            f"output_dir {output_dir} already holds committed checkpoints ({names}): continue "
            "with checkpoint.resume_from_checkpoint=true (or auto), or pick another output_dir"
        )
    if resume is True and not existing:
        raise CheckpointError(
            f"checkpoint.resume_from_checkpoint=true but {output_dir} holds no committed "
            "checkpoint: set it to auto to start fresh when there is none"
        )


def move_aside(path: Path) -> Path:
    """Rename a bad step directory to ``{name}.corrupt-{time}`` (never resumed or pruned).

    Returns:
        The new path.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    suffix = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{suffix}")
        suffix += 1
    os.replace(path, target)
    fsync_path(path.parent)
    return target


def remove_stale(output_dir: str | os.PathLike) -> list[Path]:
    """Delete what killed runs left in ``output_dir``.

    That is uncommitted step directories, and temporary files and folders of tunelab's
    naming in it and in its step, epoch and adapter folders.

    Call only from the process that owns ``output_dir`` (holds its lock), before it writes.

    Returns:
        The deleted paths.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    deleted = []
    for path in list(root.iterdir()):
        uncommitted_step = (
            _STEP_PATTERN.match(path.name) and path.is_dir() and not (path / MANIFEST_NAME).exists()
        )
        if uncommitted_step or is_temporary_name(path.name):
            _remove(path)
            deleted.append(path)
    folders = [
        path
        for path in root.iterdir()
        if path.is_dir() and (_STEP_PATTERN.match(path.name) or path.name.startswith("epoch_"))
    ]
    folders += [folder / "adapter" for folder in folders if (folder / "adapter").is_dir()]
    for folder in folders:
        for path in list(folder.iterdir()):
            if is_temporary_name(path.name):
                _remove(path)
                deleted.append(path)
    return deleted


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def prune(output_dir: str | os.PathLike, keep_last_n: int) -> list[Path]:
    """Delete committed step directories older than the newest ``keep_last_n``.

    Only committed directories are candidates, so the one in flight (not committed yet)
    and the newest committed one (``keep_last_n >= 1``) are never deleted. The manifest
    goes first, so a crash mid-delete leaves an uncommitted folder, never a committed
    one with missing files.

    Args:
        output_dir: The run's output folder.
        keep_last_n: How many committed checkpoints to keep (at least 1).

    Returns:
        The deleted directories.
    """
    if keep_last_n < 1:
        raise ValueError("keep_last_n must be at least 1")
    checkpoints = committed_checkpoints(output_dir)
    deleted = []
    for checkpoint in checkpoints[:-keep_last_n]:
        (checkpoint.path / MANIFEST_NAME).unlink()
        shutil.rmtree(checkpoint.path)
        deleted.append(checkpoint.path)
    return deleted
