"""``StreamingDataset``: rows read, tokenized and packed on the fly, never materialised.

``streaming: true`` on an SFT builder returns this instead of a ``TokenizedDataset``: nothing
is tokenized ahead and no Arrow cache is written. The stream is one deterministic sequence that
every rank reproduces, so that its position is a few integers, free of the world size:

1. **Rows**: the sources in order (a local folder is expanded to its data files, sorted by
   path), each file's rows in order. Rows are found without being decoded
   (``tunelab.data.stream_rows``: JSON Lines by their line ends, Parquet and Arrow by their
   metadata); a JSON document is parsed whole (with the ``json`` module, as the materialised
   path reads it), CSV, text and hub datasets go through ``datasets`` streaming.
2. **Shuffle**: the rows are cut into consecutive windows of ``shuffle_buffer_size`` rows and
   window ``w`` of epoch ``e`` is read in the order ``permutation(seed, e, w)`` (numpy's
   ``default_rng([seed, e, w])``). The buffer's content is a function of its position, so the
   position alone restores it: no buffered row is saved.
3. **Tokenize, by rank**: of the window's rows still to be read, rank ``r`` of ``W`` takes the
   ``r``-th of ``W`` contiguous runs in stream order (by file and row), decodes only those
   (JSON-decodes its lines, reads its Parquet row groups and Arrow rows) and tokenizes them
   with the builder's own row function (``cache.TokenizeRows``, the code the materialised path
   runs: same templates, masks and malformed-row errors). This happens in ``num_proc``
   DataLoader worker processes, windows ahead of the training step; the training process
   gathers each window's samples from every rank (one ``all_gather_object``) and packs.
4. **Pack** (``packed: true``): greedily in stream order (``pack_samples``' rule). A pack is
   closed by the first sample that does not fit, so restarting the packer at the first sample
   of the open pack rebuilds the same packs: the packing remainder is that sample's location.

A **location** ``{"window", "source", "row", "taken", "sample"}`` names one sample: window
``window`` starts at row ``row`` of source ``source``; the sample is number ``sample`` of the
row at position ``taken`` in the window's permuted order. ``items`` yields every item with the
location of the first sample not yet in an item, which is all a checkpoint needs to resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import numpy as np

from tunelab.data.cache import SAMPLE_COLUMNS, RowFunction, TokenizeRows, malformed_message
from tunelab.data.packing import pack_samples
from tunelab.data.rows import IGNORE_INDEX
from tunelab.data.sources import Source
from tunelab.data.stream_ranks import WindowPart, gather_window, rank_and_world_size, read_ahead
from tunelab.data.stream_rows import DecodeCount, RowRef, columns_of, decode, walk
from tunelab.data.tokenizer import UNKNOWN_CHECK_SAMPLES, Tokenizer, check_tokens_fit
from tunelab.errors import ConfigError, DataError

DEFAULT_SHUFFLE_BUFFER = 1000
"""Rows per shuffle window when ``shuffle_buffer_size`` is not set."""

LOCATION_KEYS = ("window", "source", "row", "taken", "sample")


def start_location() -> dict[str, int]:
    """The location of an epoch's first sample."""
    return dict.fromkeys(LOCATION_KEYS, 0)


class StreamingDataset:
    """SFT samples (or packs) streamed from ``sources`` in a seeded, resumable order.

    Items are what ``TokenizedDataset`` gives: ``{"tokens", "labels"}``, packs adding
    ``input_pos`` and ``document_ids``. There is no ``len``: an epoch is one pass over the
    sources, cut by the recipe's ``max_steps_per_epoch``.

    Args:
        tokenizer: The tokenizer (its ``pad_id`` pads packs).
        rows_for: A source's name and columns to its row function.
        sources: The sources, in stream order.
        skip_malformed: Skip malformed rows instead of raising on the first.
        packed: Pack samples into ``max_seq_len`` sequences.
        max_seq_len: The pack length.
        shuffle_buffer_size: Rows per shuffle window (1: read in order).
        num_proc: DataLoader worker processes per rank that read and tokenize windows ahead
            of the training step (0: in the calling process, when the items are asked for).

    Attributes:
        decoded: What this rank has decoded so far (rows; bytes of JSON lines).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        rows_for: Callable[[str, list[str]], RowFunction],
        sources: list[Source],
        skip_malformed: bool,
        packed: bool,
        max_seq_len: int | None,
        shuffle_buffer_size: int,
        num_proc: int = 1,
    ) -> None:
        if shuffle_buffer_size < 1:
            raise ConfigError(f"shuffle_buffer_size must be at least 1, got {shuffle_buffer_size}")
        if num_proc < 0:
            raise ConfigError(f"dataset.num_proc must be at least 0 with streaming, got {num_proc}")
        self.sources = sources
        self.packed = packed
        self.shuffle_buffer_size = shuffle_buffer_size
        self.num_proc = num_proc
        self.decoded = DecodeCount()
        self._rows_for = rows_for
        self._skip_malformed = skip_malformed
        self._max_seq_len = max_seq_len
        self._pad_id = tokenizer.pad_id
        self._functions: dict[tuple[int, tuple[str, ...]], TokenizeRows] = {}

    def _refs(self, source: int, row: int) -> Iterator[RowRef]:
        """Every row of the stream from ``(source, row)`` on, undecoded."""
        for index in range(source, len(self.sources)):
            yield from walk(self.sources[index], index, row)
            row = 0

    def _tokenize(self, source: int, row: int, batch: dict[str, list[Any]]) -> list[dict]:
        """The samples of one decoded row (none for a skipped malformed row)."""
        json_rows_ = self.sources[source].kind == "json"
        columns = columns_of(batch, json_rows_)
        if columns is None:  # not an object: TokenizeRows reports it without a row function
            function = TokenizeRows(_no_rows, "sft", source, json_rows_)
        else:
            # Keyed by the row's own columns (nothing is read ahead), so a row's samples do not
            # depend on which rows a rank or a resumed run tokenized before it.
            key = (source, tuple(columns))
            function = self._functions.get(key)
            if function is None:
                try:
                    rows = self._rows_for(self.sources[source].name, columns)
                except DataError:
                    if self._skip_malformed:
                        return []
                    raise
                max_chars = getattr(rows, "max_chars", None)
                function = TokenizeRows(rows, "sft", source, json_rows_, max_chars)
                self._functions[key] = function
        out = function(batch, [row])
        if out["problem"] and out["problem"][0] is not None:
            if self._skip_malformed:
                return []
            records = [{name: values[0] for name, values in out.items()}]
            names = [source.name for source in self.sources]
            raise DataError(malformed_message(records, 0, names))
        return [
            {name: out[name][i] for name in SAMPLE_COLUMNS["sft"]}
            for i in range(len(out["tokens"]))
        ]

    def _tokenize_share(
        self, part: WindowPart, buffer: list[RowRef], order: np.ndarray, rank: int, world_size: int
    ) -> None:
        """Decode and tokenize rank ``rank``'s share of a window's unread rows into ``part``.

        The unread rows (permuted positions ``taken`` on) are split, in stream order, into
        ``world_size`` contiguous runs; the rank's run is tokenized in permuted order up to its
        first malformed row, so the smallest position any rank reports is the window's first.
        """
        unread = np.sort(order[part.taken :])
        lo, hi = len(unread) * rank // world_size, len(unread) * (rank + 1) // world_size
        share = set(unread[lo:hi].tolist())
        positions = [p for p in range(part.taken, part.size) if order[p] in share]
        try:
            batches = decode(self.sources, [buffer[order[p]] for p in positions], part.decoded)
        except DataError as error:
            part.error = (positions[0], str(error))
            return
        for position, batch in zip(positions, batches):
            ref = buffer[order[position]]
            try:
                samples = self._tokenize(ref.source, ref.row, batch)
                part.samples[position] = [
                    {name: np.asarray(values, dtype=np.int32) for name, values in sample.items()}
                    for sample in samples
                ]
            except DataError as error:
                part.error = (position, str(error))
                return

    def window_parts(
        self,
        epoch: int,
        seed: int,
        location: dict[str, int],
        rank: int,
        world_size: int,
        worker: int = 0,
        num_workers: int = 1,
    ) -> Iterator[WindowPart]:
        """Rank ``rank``'s part of every window from ``location`` on, then the end (size 0).

        Touches no process group, so it runs in a DataLoader worker. Worker ``worker`` of
        ``num_workers`` yields every ``num_workers``-th window (the DataLoader's round-robin
        puts them back in order); each worker still walks every row, undecoded.
        """
        window, taken = location["window"], location["taken"]
        refs = self._refs(location["source"], location["row"])
        while True:
            buffer = list(islice(refs, self.shuffle_buffer_size))
            mine = (window - location["window"]) % num_workers == worker
            if not buffer:
                if mine:
                    yield WindowPart(window, len(self.sources), 0, 0, 0)
                return
            if mine:
                part = WindowPart(window, buffer[0].source, buffer[0].row, taken, len(buffer))
                order = np.random.default_rng([seed, epoch, window]).permutation(len(buffer))
                if self.shuffle_buffer_size == 1:
                    order = np.arange(len(buffer))
                self._tokenize_share(part, buffer, order, rank, world_size)
                yield part
            taken = 0
            window += 1

    def parts(
        self, epoch: int, seed: int, location: dict[str, int], num_proc: int
    ) -> Iterator[WindowPart]:
        """This rank's window parts from ``location`` on: ``read_ahead`` of ``window_parts``."""
        rank, world_size = rank_and_world_size()
        if num_proc == 0:
            return self.window_parts(epoch, seed, location, rank, world_size)
        return read_ahead(self.window_parts, (epoch, seed, location, rank, world_size), num_proc)

    def _samples(
        self, epoch: int, seed: int, location: dict[str, int], num_proc: int | None = None
    ) -> Iterator[tuple[dict | None, dict[str, int]]]:
        """``(sample, its location)`` from ``location`` on, then ``(None, end location)``."""
        first = location["sample"]
        num_proc = self.num_proc if num_proc is None else num_proc
        for part in self.parts(epoch, seed, location, num_proc):
            self.decoded.add(part.decoded)
            start = {"window": part.window, "source": part.source, "row": part.row}
            if part.size == 0:
                yield None, {**start, "taken": 0, "sample": 0}
                return
            window_samples = gather_window(part)
            for position in range(part.taken, part.size):
                samples = window_samples[position]
                for number in range(first, len(samples)):
                    yield samples[number], {**start, "taken": position, "sample": number}
                first = 0

    def items(
        self, epoch: int, seed: int, location: dict[str, int]
    ) -> Iterator[tuple[dict[str, list[int]], dict[str, int]]]:
        """Yield ``(item, next location)`` from ``location`` to the end of the sources.

        Args:
            epoch: The epoch (seeds the shuffle with ``seed``).
            seed: The data seed.
            location: Where to start (``start_location()`` or one yielded before).

        Yields:
            Each item and the location of the first sample not in it or an earlier item.

        Raises:
            DataError: For a malformed row (unless skipped) or a source that cannot be read.
        """
        samples = self._samples(epoch, seed, location)
        if not self.packed:
            previous = None
            for sample, where in samples:
                if previous is not None:
                    yield previous, where
                previous = sample
            return
        pending: list[dict] = []
        used = 0
        for sample, where in samples:
            if sample is None or used + len(sample["tokens"]) > self._max_seq_len:
                if pending:
                    (pack,) = pack_samples(pending, self._max_seq_len, self._pad_id, IGNORE_INDEX)
                    yield pack, where
                pending, used = [], 0
            if sample is not None:
                pending.append(sample)
                used += len(sample["tokens"])

    def check_tokens_fit(self, tokenizer: Tokenizer) -> None:
        """``check_tokens_fit`` on the first samples of epoch 0's stream (reads one window)."""
        lists = []
        first = self._samples(0, 0, start_location(), num_proc=0)
        for sample, _ in islice(first, UNKNOWN_CHECK_SAMPLES):
            if sample is not None:
                lists.append(list(sample["tokens"]))
        check_tokens_fit(tokenizer, lists, ", ".join(source.name for source in self.sources))


def _no_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    raise AssertionError("TokenizeRows reports a row that is not an object itself")
