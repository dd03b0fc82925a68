"""``StreamingDataset``: rows read, tokenized and packed on the fly, never materialised.

``streaming: true`` on an SFT builder returns this instead of a ``TokenizedDataset``: nothing
is tokenized ahead and no Arrow cache is written. The stream is one deterministic sequence that
every rank reproduces, so that its position is a few integers, free of the world size:

1. **Rows**: the sources in order (a local folder is expanded to its data files, sorted by
   path), each file's rows in order. JSON / JSONL are read with the ``json`` module as the
   materialised path reads them (``tunelab._json_lines``); Parquet, Arrow, CSV, text and hub
   datasets through ``datasets.load_dataset(..., streaming=True)``.
2. **Shuffle**: the rows are cut into consecutive windows of ``shuffle_buffer_size`` rows and
   window ``w`` of epoch ``e`` is read in the order ``permutation(seed, e, w)`` (numpy's
   ``default_rng([seed, e, w])``). The buffer's content is a function of its position, so the
   position alone restores it: no buffered row is saved.
3. **Tokenize**: each row goes through the builder's own row function (``cache.TokenizeRows``,
   the code the materialised path runs): same templates, same masks, same malformed-row errors.
   The rows of a window are shared out over the ranks by position and the samples gathered,
   so each rank tokenizes ``1/W`` of the stream.
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
from pathlib import Path
from typing import Any

import numpy as np

from tunelab._json_lines import json_rows
from tunelab.data.cache import SAMPLE_COLUMNS, RowFunction, TokenizeRows, malformed_message
from tunelab.data.packing import pack_samples
from tunelab.data.rows import IGNORE_INDEX
from tunelab.data.sources import JSON_LINE, JSON_PROBLEM, JSON_TEXT, Source
from tunelab.data.tokenizer import UNKNOWN_CHECK_SAMPLES, Tokenizer, check_tokens_fit
from tunelab.errors import ConfigError, DataError

DEFAULT_SHUFFLE_BUFFER = 1000
"""Rows per shuffle window when ``shuffle_buffer_size`` is not set."""

LOCATION_KEYS = ("window", "source", "row", "taken", "sample")
_JSON_KEYS = "_keys"


def start_location() -> dict[str, int]:
    """The location of an epoch's first sample."""
    return dict.fromkeys(LOCATION_KEYS, 0)


def _rows_of(source: Source, start: int) -> Iterator[dict[str, list[Any]]]:
    """The rows of one source from row ``start`` on, each as a one-row ``TokenizeRows`` batch."""
    if source.kind == "json":
        rows = json_rows(Path(source.name), source.kwargs.get("field"))
        for text, line, row in islice(rows, start, None):
            yield {
                JSON_TEXT: [text],
                JSON_LINE: [line],
                JSON_PROBLEM: [row if text is None else None],
                # The keys of a row already parsed here (TokenizeRows parses the text itself).
                _JSON_KEYS: [list(row) if text is not None and isinstance(row, dict) else None],
            }
        return
    import datasets

    if source.kind == "hub":
        loader, files, split = source.loader, source.data_files, source.split
    else:
        loader, files, split = source.loader, source.name, "train"
    try:
        stream = datasets.load_dataset(
            loader, data_files=files, split=split, streaming=True, **source.kwargs
        )
    except Exception as error:  # offline, unknown repo, bad file: one message
        raise DataError(f"{source.name}: cannot stream ({error})") from error
    for row in stream.skip(start) if start else stream:
        yield {name: [value] for name, value in row.items()}


def _columns(batch: dict[str, list[Any]], json_rows_: bool) -> list[str] | None:
    """The columns a row shows (its keys), or None for a JSON line that is not an object."""
    return batch[_JSON_KEYS][0] if json_rows_ else list(batch)


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
    ) -> None:
        if shuffle_buffer_size < 1:
            raise ConfigError(f"shuffle_buffer_size must be at least 1, got {shuffle_buffer_size}")
        self.sources = sources
        self.packed = packed
        self.shuffle_buffer_size = shuffle_buffer_size
        self._rows_for = rows_for
        self._skip_malformed = skip_malformed
        self._max_seq_len = max_seq_len
        self._pad_id = tokenizer.pad_id
        self._functions: dict[tuple[int, tuple[str, ...]], TokenizeRows] = {}

    def _rows(self, source: int, row: int) -> Iterator[tuple[int, int, dict[str, list[Any]]]]:
        """``(source, row, batch)`` for every row of the stream from ``(source, row)`` on."""
        for index in range(source, len(self.sources)):
            for offset, batch in enumerate(_rows_of(self.sources[index], row)):
                yield index, row + offset, batch
            row = 0

    def _tokenize(self, source: int, row: int, batch: dict[str, list[Any]]) -> list[dict]:
        """The samples of one row (none for a skipped malformed row)."""
        json_rows_ = self.sources[source].kind == "json"
        columns = _columns(batch, json_rows_)
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

    def _tokenize_window(
        self, buffer: list[tuple[int, int, dict]], order: np.ndarray, taken: int
    ) -> dict[int, list[dict]]:
        """The samples of the window's rows from permuted position ``taken`` on, by position.

        Sharded by row: rank ``r`` of ``W`` tokenizes positions ``taken + r``, ``taken + r +
        W``, ... and one ``all_gather_object`` gives every rank all of them (every rank reads
        the same stream, so every rank gathers at the same point). A malformed row raises on
        every rank, the first one by position.
        """
        import torch.distributed as dist

        distributed = dist.is_initialized() and dist.get_world_size() > 1
        world_size, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
        mine: dict[int, list[dict]] = {}
        error = None
        for position in range(taken + rank, len(buffer), world_size):
            try:
                mine[position] = self._tokenize(*buffer[order[position]])
            except DataError as raised:
                error = (position, str(raised))
                break
        if not distributed:
            if error is not None:
                raise DataError(error[1])
            return mine
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (mine, error))
        errors = [error for _, error in gathered if error is not None]
        if errors:
            raise DataError(min(errors)[1])
        return {position: samples for part, _ in gathered for position, samples in part.items()}

    def _samples(
        self, epoch: int, seed: int, location: dict[str, int]
    ) -> Iterator[tuple[dict | None, dict[str, int]]]:
        """``(sample, its location)`` from ``location`` on, then ``(None, end location)``."""
        window, taken, first = location["window"], location["taken"], location["sample"]
        rows = self._rows(location["source"], location["row"])
        while True:
            buffer = list(islice(rows, self.shuffle_buffer_size))
            if not buffer:
                break
            start = {"window": window, "source": buffer[0][0], "row": buffer[0][1]}
            order = np.random.default_rng([seed, epoch, window]).permutation(len(buffer))
            if self.shuffle_buffer_size == 1:
                order = np.arange(len(buffer))
            window_samples = self._tokenize_window(buffer, order, taken)
            for position in range(taken, len(buffer)):
                samples = window_samples[position]
                for number in range(first, len(samples)):
                    yield samples[number], {**start, "taken": position, "sample": number}
                first = 0
            taken = 0
            window += 1
        yield (
            None,
            {"window": window, "source": len(self.sources), "row": 0, "taken": 0, "sample": 0},
        )

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
        for sample, _ in islice(self._samples(0, 0, start_location()), UNKNOWN_CHECK_SAMPLES):
            if sample is not None:
                lists.append(list(sample["tokens"]))
        check_tokens_fit(tokenizer, lists, ", ".join(source.name for source in self.sources))


def _no_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    raise AssertionError("TokenizeRows reports a row that is not an object itself")
