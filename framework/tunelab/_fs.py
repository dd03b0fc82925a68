"""Durability on the filesystem: the one fsync helper every writer shares, and an atomic swap."""

import ctypes
import errno
import functools
import os
import sys


def fsync_path(path: str | os.PathLike) -> None:
    """Fsync a file, or a folder so that renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange_paths(first: str | os.PathLike, second: str | os.PathLike) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    A reader, or a crash, sees either both old names or both new ones: never a moment when
    one of them is missing.

    Returns:
        False where the system cannot (not Linux, an old kernel or C library, a filesystem
        without it): the caller falls back to two renames.
    """
    function = _renameat2()
    if function is None:
        return False
    at_cwd, rename_exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    result = function(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), rename_exchange)
    if result == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(error, os.strerror(error), os.fspath(first))


@functools.cache
def _renameat2():  # noqa: ANN202 - a ctypes function or None
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    function.restype = ctypes.c_int
    return function
