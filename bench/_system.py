"""Peak resident memory of a process and the page cache of files (Linux ``/proc``)."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterable
from pathlib import Path


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return _status_kib("VmRSS") * 1024


class PeakRSS:
    """Peak growth of this process's resident set size over a ``with`` block.

    Linux keeps the peak RSS of a process (``VmHWM``) and resets it to the current RSS when
    ``5`` is written to ``/proc/self/clear_refs``; the growth is then ``VmHWM`` after the
    block minus ``VmRSS`` before it. This is exact (the kernel updates the peak on every page
    fault), unlike sampling. Where ``clear_refs`` cannot be written, a thread samples
    ``VmRSS`` every millisecond instead (``exact`` is then False), which can miss short peaks.
    Memory the allocator had cached before the block and reuses inside it is not counted:
    it was resident already, so glibc is first asked to return its free memory to the
    system (``malloc_trim(0)``), making the baseline the memory actually in use.
    """

    def __init__(self) -> None:
        self.peak_growth = 0
        self.exact = True
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._sampled_peak = 0

    def __enter__(self) -> PeakRSS:
        release_free_memory()
        self._before = rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        except OSError:
            self.exact = False
            self._sampled_peak = self._before
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._sampled_peak = max(self._sampled_peak, rss_bytes())

    def __exit__(self, *exc_info: object) -> None:
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            peak = max(self._sampled_peak, rss_bytes())
        else:
            peak = _status_kib("VmHWM") * 1024
        self.peak_growth = max(0, peak - self._before)


def release_free_memory() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``; else no-op)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> None:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS, where Linux allows it."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """Peak RSS of this process since start or the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


# -- page cache --------------------------------------------------------------------------


def drop_from_page_cache(paths: Iterable[Path]) -> None:
    """Ask the kernel to drop these files' clean pages from the page cache.

    ``posix_fadvise(DONTNEED)`` needs no privileges (unlike ``/proc/sys/vm/drop_caches``)
    and drops pages already written back, so fsync first. The next read comes from disk,
    or from the host's cache on a virtual machine: "cold" here means "not in this kernel's
    page cache".
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(directory: Path) -> list[Path]:
    """Every regular file below ``directory``, sorted."""
    return sorted(path for path in Path(directory).rglob("*") if path.is_file())


def process_tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and every live process under it.

    Read from ``/proc/<pid>/stat`` (fields 14 and 15, in clock ticks); a process that ends
    while it is read counts 0.
    """
    parents: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                # The command name (field 2) may hold spaces: split after its closing ")".
                fields = handle.read().rpartition(")")[2].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry))
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        total += ticks.get(current, 0)
        pending.extend(parents.get(current, []))
    return total / os.sysconf("SC_CLK_TCK")
