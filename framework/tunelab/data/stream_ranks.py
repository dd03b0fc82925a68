"""A stream over ranks: window parts read ahead in DataLoader workers, gathered on the step's process.

``StreamingDataset.window_parts`` gives what one rank decodes and tokenizes of each window; it
touches no process group, so ``read_ahead`` runs it in forked ``DataLoader`` worker processes,
up to two windows ahead of the training step. The training process then gathers each window's
samples from every rank (``gather_window``: one ``all_gather_object``, the collective the
workers cannot join) and packs them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from tunelab.data.stream_rows import DecodeCount
from tunelab.errors import DataError
from tunelab.lifecycle.preemption import leave_stop_signals_to_parent, stop_signals_blocked


@dataclass
class WindowPart:
    """What one rank tokenized of one window (or, with ``size`` 0, the end of the stream).

    Attributes:
        window: The window's index in the epoch.
        source: The source of its first row.
        row: Its first row in that source.
        taken: The first permuted position read (non-zero only in a resumed window).
        size: Rows in the window; 0 past the last window.
        samples: Permuted position to that row's samples, for this rank's rows; their token
            columns as int32 arrays (pickled as raw bytes to the training process and in the
            gather, about 4x cheaper than lists of ints), lists again after ``gather_window``.
        error: ``(position, message)`` of this rank's first malformed row by position.
        decoded: What this rank decoded for it.
        pid: The process that read and tokenized it.
    """

    window: int
    source: int
    row: int
    taken: int
    size: int
    samples: dict[int, list[dict]] = field(default_factory=dict)
    error: tuple[int, str] | None = None
    decoded: DecodeCount = field(default_factory=DecodeCount)
    pid: int = field(default_factory=os.getpid)


def _rank_and_world_size() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without a group of several)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def read_ahead(
    window_parts: Callable[..., Iterator[WindowPart]], args: tuple, num_proc: int
) -> Iterator[WindowPart]:
    """``window_parts(*args, worker, num_workers)`` in ``num_proc`` workers, in window order.

    Worker ``k`` makes every ``num_proc``-th window from the ``k``-th on; the DataLoader's
    round-robin puts them back in order. Each worker holds up to two windows ahead
    (``prefetch_factor``) while the training process gathers and trains on the current one.
    """
    loader = DataLoader(
        _WindowParts(window_parts, args),
        batch_size=None,
        num_workers=num_proc,
        collate_fn=_as_is,
        prefetch_factor=2,
        # Forked, not spawned: the builders' row functions are closures, not picklable
        # (and a fork shares the tokenizer's pages).
        multiprocessing_context="fork",
        # Its own generator: a worker's seed is drawn from it, not from the global RNG
        # (which a resume restores and dropout uses).
        generator=torch.Generator().manual_seed(0),
        # The training process owns SIGTERM and SIGINT: a worker killed by the one torchrun
        # or SLURM sends every process would fail the step before its checkpoint.
        worker_init_fn=leave_stop_signals_to_parent,
    )
    # The workers are forked here: with the stop signals blocked, so they wait for the
    # worker_init_fn (in the training process they are delivered when the block ends).
    with stop_signals_blocked():
        return iter(loader)


def gather_window(part: WindowPart) -> dict[int, list[dict]]:
    """Every rank's samples of one window (one ``all_gather_object``), or the first error.

    Every rank walks the same windows, so every rank gathers at the same point. A
    malformed row raises on every rank, the first one by position.
    """
    import torch.distributed as dist

    _, world_size = rank_and_world_size()
    gathered: list[Any] = [(part.samples, part.error)]
    if world_size > 1:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (part.samples, part.error))
    errors = [error for _, error in gathered if error is not None]
    if errors:
        raise DataError(min(errors)[1])
    return {
        position: [{name: array.tolist() for name, array in sample.items()} for sample in samples]
        for share, _ in gathered
        for position, samples in share.items()
    }


class _WindowParts(IterableDataset):
    """``window_parts(*args, worker, num_workers)`` as a DataLoader's dataset (in its workers)."""

    def __init__(self, window_parts: Callable[..., Iterator[WindowPart]], args: tuple) -> None:
        self.window_parts, self.args = window_parts, args

    def __iter__(self) -> Iterator[WindowPart]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.window_parts(*self.args, worker, num_workers)


def _as_is(part: WindowPart) -> WindowPart:
    """The DataLoader's collate function: a window part is passed on as it is."""
    return part
