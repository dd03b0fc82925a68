"""The commit marker (an atomic, checksummed manifest), atomic writes and temporary names.

Which folders exist in an output_dir, and what may be removed from it, is
``tunelab.lifecycle.RunFolder``'s business; this module is the file format. A step directory counts only once it is committed: after every rank's files are durable,
rank 0 writes ``MANIFEST_NAME`` atomically (temp file, fsync, rename, fsync of the folder),
listing every file of the save with its size and checksums (``tunelab.formats.integrity``).
Resume, retention and every "latest" lookup ignore directories without it, so a crash
mid-save can never leave a half-written checkpoint that looks resumable.
"""

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from tunelab._fs import fsync_path
from tunelab.errors import CheckpointError
from tunelab.formats.integrity import (
    DIGEST_NAME,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    FileRecord,
    read_manifest_file,
)

logger = logging.getLogger(__name__)

# Names tunelab gives files and folders while it writes them: ``.{name}.tunelab-{kind}`` with an
# optional ``-{tag}`` (a pid). The ``tunelab-`` part keeps a user's ``.env.old`` or
# ``.cache.partial`` out of the pattern: clean-up removes only what matches it.
_TEMPORARY_KINDS = ("tmp", "old", "partial")
_TEMPORARY_PATTERN = re.compile(r"^\.(.+)\.tunelab-(tmp|old|partial)(-[A-Za-z0-9_]+)?$")


def temporary_name(name: str, kind: str, tag: str | int | None = None) -> str:
    """The hidden name ``name`` is written under until it is renamed into place.

    Args:
        name: The final file or folder name.
        kind: ``tmp`` (being written), ``partial`` (a folder being filled by several ranks)
            or ``old`` (the previous version, moved aside while the new one goes in).
        tag: Makes the name unique to a writer (its pid), or None.

    Returns:
        ``.{name}.tunelab-{kind}[-{tag}]``.
    """
    assert kind in _TEMPORARY_KINDS, kind
    return f".{name}.tunelab-{kind}" + ("" if tag is None else f"-{tag}")


def is_temporary_name(name: str) -> bool:
    """Whether ``name`` is one tunelab gives a file or folder while writing it."""
    return bool(_TEMPORARY_PATTERN.match(name))


def parse_temporary_name(name: str) -> tuple[str, str] | None:
    """``(final name, kind)`` of a temporary name (``temporary_name``'s inverse), or None."""
    match = _TEMPORARY_PATTERN.match(name)
    return (match.group(1), match.group(2)) if match else None


def write_atomic(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one.

    Writes a temp file in the same folder, fsyncs it, renames it over ``path`` and fsyncs
    the folder, so the rename itself survives a power loss (``sync=False`` skips both fsyncs:
    atomic for readers, not durable across a power loss).
    """
    temp_path = path.with_name(temporary_name(path.name, "tmp", os.getpid()))
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
    if not os.path.lexists(directory / MANIFEST_NAME):
        return None
    # A manifest that is a link, a FIFO or a device is there but unreadable: the step is
    # reported (and passed over on resume), not taken for one still being written.
    return read_manifest_file(directory)


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


def retire_folder(path: Path, final_name: str) -> Path | None:
    """Remove a replaced folder that tunelab wrote; keep aside one that holds anything else.

    The folder is tunelab's own when every file in it is listed by its manifest or by the
    manifest of a sub-folder (an export's ``adapter/``), or is a temporary of tunelab's
    naming. Otherwise it is renamed ``{final_name}.replaced-{time}`` and named in a warning:
    tunelab never deletes what it did not write.

    Returns:
        Where the folder was kept, or None when it was deleted.
    """
    if _only_tunelab_files(path):
        shutil.rmtree(path)
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = path.with_name(f"{final_name}.replaced-{stamp}")
    suffix = 1
    while kept.exists():
        kept = path.with_name(f"{final_name}.replaced-{stamp}-{suffix}")
        suffix += 1
    os.replace(path, kept)
    logger.warning("kept %s aside as %s: it holds files tunelab did not write", final_name, kept)
    return kept


def _only_tunelab_files(folder: Path) -> bool:
    listed: set[Path] = set()
    for manifest_path in folder.rglob(MANIFEST_NAME):
        if manifest_path.is_symlink():
            return False
        try:
            files = read_manifest_file(manifest_path.parent)["files"]
        except (CheckpointError, KeyError, TypeError):
            return False
        listed |= {manifest_path.parent / name for name in files} | {manifest_path}
    for path in folder.rglob("*"):
        if path.is_symlink():
            return False
        if path.is_file() and path not in listed and not is_temporary_name(path.name):
            if not any(is_temporary_name(part) for part in path.relative_to(folder).parts):
                return False
    return True
