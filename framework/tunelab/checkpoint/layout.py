"""Checkpoint directory layout, the commit marker, and retention.

A step directory counts only once it is committed: after every rank's files are durable,
rank 0 writes ``MANIFEST_NAME`` atomically (temp file, fsync, rename, fsync of the folder).
Resume, retention and every "latest" lookup ignore directories without it, so a crash
mid-save can never leave a half-written checkpoint that looks resumable.
"""

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab._fs import fsync_path
from tunelab.errors import CheckpointError

MANIFEST_NAME = "tunelab_manifest.json"
"""The commit marker written last into a step directory."""
MANIFEST_VERSION = 1
_STEP_PATTERN = re.compile(r"^step_(\d+)$")


def step_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Return ``{output_dir}/step_{step}``."""
    return Path(output_dir) / f"step_{step}"


def epoch_dir(output_dir: str | os.PathLike, epoch: int) -> Path:
    """Return ``{output_dir}/epoch_{epoch}``, the Hugging Face export of an epoch."""
    return Path(output_dir) / f"epoch_{epoch}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one.

    Writes a temp file in the same folder, fsyncs it, renames it over ``path`` and fsyncs
    the folder, so the rename itself survives a power loss.
    """
    temp_path = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temp_path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp_path, path)
    fsync_path(path.parent)


def list_files(directory: Path) -> dict[str, int]:
    """Return every file under ``directory`` (relative POSIX path) with its byte size."""
    files = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != MANIFEST_NAME:
            files[path.relative_to(directory).as_posix()] = path.stat().st_size
    return files


def commit(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Commit a step directory: list its files and write the manifest atomically.

    Args:
        directory: The step directory, whose files every rank has made durable.
        manifest: Step, epoch, world size, config hash, versions and the rest; the file
            list is added here.

    Returns:
        The manifest as written.
    """
    manifest = {"manifest_version": MANIFEST_VERSION, **manifest, "files": list_files(directory)}
    write_atomic(directory / MANIFEST_NAME, json.dumps(manifest, indent=2).encode())
    return manifest


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """Return a step directory's manifest, or None when it is not committed."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable checkpoint manifest ({error})") from error


def verify(directory: Path, manifest: dict[str, Any]) -> str | None:
    """Check that every file the manifest lists exists with its recorded size.

    Returns:
        None when complete, else a sentence naming the first problem.
    """
    for name, size in manifest.get("files", {}).items():
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{path} has {actual} bytes, the manifest recorded {size}"
    return None


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed step directory and its manifest."""

    step: int
    path: Path
    manifest: dict[str, Any]


def committed_checkpoints(output_dir: str | os.PathLike) -> list[CommittedCheckpoint]:
    """Return the committed step directories under ``output_dir``, oldest first.

    Directories without a manifest (in flight, or left by a crash) are not listed.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_PATTERN.match(path.name)
        if not match or not path.is_dir():
            continue
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            manifest = None
        if manifest is not None:
            found.append(CommittedCheckpoint(int(match.group(1)), path, manifest))
    return sorted(found, key=lambda checkpoint: checkpoint.step)


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
