"""Reading a model folder tunelab was handed: links followed only where they belong.

A model folder (``checkpoint_dir``, a tokenizer path, ``adapter_dir``) is data someone else
may have prepared. A link in it (``tokenizer.model -> /proc/self/environ``, ``merges.txt ->
/etc/shadow``) would have tunelab read, and an export publish, a file from outside it. So a
file of a model folder is opened only when it resolves to a regular file

* inside the folder itself (``tokenizer.json -> sub/tokenizer.json``), or
* for a Hugging Face cache snapshot (``models--org--name/snapshots/<rev>/config.json ->
  ../../blobs/<hash>``), inside that repository's blob store ``models--org--name/blobs``;

anything else is one ``CheckpointError`` naming the link and where it leads. The folder itself
may be a link (``models/llama -> /data/hub/.../snapshots/<rev>``): it is the user's choice.
Only regular files are opened: a FIFO, a device or a socket is refused before any read.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from tunelab.errors import CheckpointError

__all__ = [
    "bad_links",
    "model_file",
    "open_model_file",
    "read_model_bytes",
    "read_model_text",
]

_HUB_PREFIXES = ("models--", "datasets--", "spaces--")


def _blob_store(folder: Path) -> Path | None:
    """The blob store of the Hugging Face cache repository ``folder`` is a snapshot of."""
    for snapshot in (folder, *folder.parents):
        snapshots = snapshot.parent
        if snapshots.name == "snapshots" and snapshots.parent.name.startswith(_HUB_PREFIXES):
            return snapshots.parent / "blobs"
    return None


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _link_problem(path: Path, folder: Path) -> str | None:
    """Why ``path`` may not be read as a file of ``folder``, or None when it may."""
    root = folder.resolve()
    target = path.resolve()
    if _inside(target, root):
        return None
    blobs = _blob_store(root)
    if blobs is not None and _inside(target, blobs.resolve()):
        return None
    how = "is a link to" if path.is_symlink() else "leads to"
    return (
        f"{path} {how} {target}, outside the model folder {folder}: tunelab follows links in "
        "a model folder only to files inside it (or, in a Hugging Face cache snapshot, to the "
        "repository's blobs); replace the link with the file itself"
    )


def model_file(path: str | os.PathLike, folder: str | os.PathLike | None = None) -> Path:
    """Check that ``path`` may be read as a file of the model folder ``folder``.

    Args:
        path: A file in the folder (or in a sub-folder of it).
        folder: The model folder; ``path``'s parent when None.

    Returns:
        The file's resolved path (no link left in it).

    Raises:
        CheckpointError: If a link on the way leads outside the folder (and its hub cache blob
            store), or the file is not a regular file.
        FileNotFoundError: If there is no such file.
    """
    path = Path(path)
    folder = Path(folder) if folder is not None else path.parent
    problem = _link_problem(path, folder)
    if problem is not None:
        raise CheckpointError(problem)
    resolved = path.resolve()
    mode = os.stat(resolved).st_mode  # FileNotFoundError for a missing file or dangling link
    if not stat.S_ISREG(mode):
        raise CheckpointError(
            f"{path} is not a regular file (a {_kind(mode)}): a model folder holds files"
        )
    return resolved


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def open_no_follow(path: str | os.PathLike, *, if_link: str) -> BinaryIO:
    """Open a file for reading: never through a link at its last step, never a FIFO or device.

    The file is opened without following a link and without blocking (a FIFO would hang),
    then checked through its descriptor, so a file swapped for a FIFO or a link after a
    caller's checks is refused too. Every reader of model and checkpoint files opens this way.

    Args:
        path: The file.
        if_link: The error message when ``path`` is a link.

    Returns:
        A binary file object, positioned at the start.

    Raises:
        CheckpointError: If it is a link (``if_link``) or not a regular file.
        FileNotFoundError: If there is no such file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CheckpointError(if_link) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{path} is not a regular file (a {_kind(mode)})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_model_file(path: str | os.PathLike, folder: str | os.PathLike | None = None) -> BinaryIO:
    """Open a file of a model folder for reading, after ``model_file``'s checks.

    Opened with ``open_no_follow``: a file swapped for a FIFO or a link between the check and
    the open is refused too.

    Args:
        path: The file.
        folder: The model folder; ``path``'s parent when None.

    Returns:
        A binary file object, positioned at the start.

    Raises:
        CheckpointError: See ``model_file``.
        FileNotFoundError: If there is no such file.
    """
    resolved = model_file(path, folder)
    return open_no_follow(resolved, if_link=f"{path} changed into a link while it was being read")


def read_model_bytes(path: str | os.PathLike, folder: str | os.PathLike | None = None) -> bytes:
    """The bytes of a file of a model folder (see ``open_model_file``)."""
    with open_model_file(path, folder) as file:
        return file.read()


def read_model_text(path: str | os.PathLike, folder: str | os.PathLike | None = None) -> str:
    """The UTF-8 text of a file of a model folder (see ``open_model_file``).

    Raises:
        UnicodeDecodeError: If the file is not UTF-8.
    """
    return read_model_bytes(path, folder).decode("utf-8")


def bad_links(folder: str | os.PathLike) -> list[str]:
    """One line per entry of ``folder`` (recursively) that ``model_file`` would refuse.

    Used by the up-front checks of a model folder, so a bad link is named before any process
    starts. Folders reached through a link are not descended into.
    """
    folder = Path(folder)
    problems = []
    for directory, subfolders, files in os.walk(folder):
        for name in sorted([*files, *subfolders]):
            path = Path(directory) / name
            if not path.is_symlink():
                continue
            problem = _link_problem(path, folder)
            if problem is None and not path.is_dir() and path.exists():
                mode = os.stat(path).st_mode
                if not stat.S_ISREG(mode):
                    problem = f"{path} is not a regular file (a {_kind(mode)})"
            if problem is not None:
                problems.append(problem)
    return problems
