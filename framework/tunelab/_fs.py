"""Durability on the filesystem: the one fsync helper every writer shares."""

import os


def fsync_path(path: str | os.PathLike) -> None:
    """Fsync a file, or a folder so that renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
