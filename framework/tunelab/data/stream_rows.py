"""A stream's rows: counted without decoding them, decoded only where a rank tokenizes them.

``StreamingDataset`` cuts the stream into windows of rows and each rank tokenizes a share of a
window. Finding a window's rows must not cost a decode of every row on every rank, so each
kind of source is walked in two steps:

- ``walk(source, start)`` yields one ``RowRef`` per row from row ``start`` on, cheaply: for
  JSON Lines the line's raw bytes (line ends are scanned, nothing is JSON-decoded); for Parquet
  and Arrow nothing at all (the row counts are in the file's metadata, resp. its record
  batches, memory-mapped).
- ``decode(sources, refs)`` turns the refs a rank tokenizes into ``TokenizeRows`` batches: it
  JSON-decodes those lines only, and reads only the Parquet row groups and Arrow rows that hold
  them (converting just those rows to Python).

Two kinds are still decoded whole on every rank: a file holding one JSON document (an array,
or an object with ``field``: its rows are known only once it is parsed) and what goes through
``datasets.load_dataset(..., streaming=True)`` (CSV, text, hub datasets, and loader options).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

from tunelab._json_lines import is_row_line, json_document, parse_line
from tunelab.data.sources import (
    JSON_LINE,
    JSON_PARSED,
    JSON_PROBLEM,
    JSON_TEXT,
    Source,
    hub_unreachable,
)
from tunelab.errors import DataError

# What ``walk`` keeps of a row until it is decoded, by how the source is read.
LINE, PARSED, LAZY = "line", "parsed", "lazy"


@dataclass
class RowRef:
    """One row of the stream, not yet decoded.

    Attributes:
        source: The source's index.
        row: The row's 0-based index in its source.
        kind: ``LINE`` (``payload`` is ``(line number, raw bytes)``), ``PARSED`` (the row as
            ``json_rows`` gives it, or a ``datasets`` row dict) or ``LAZY`` (read by ``decode``
            from the file).
        payload: See ``kind``.
    """

    source: int
    row: int
    kind: str
    payload: Any = None


@dataclass
class DecodeCount:
    """What a rank decoded.

    Attributes:
        rows: Rows decoded (handed to the row function).
        json_bytes: Bytes of the JSON Lines among them (each JSON-decoded once).
        table_rows: Rows of the Parquet row groups and Arrow ranges read for them.
    """

    rows: int = 0
    json_bytes: int = 0
    table_rows: int = 0

    def add(self, other: DecodeCount) -> None:
        """Add ``other``'s counts to these."""
        self.rows += other.rows
        self.json_bytes += other.json_bytes
        self.table_rows += other.table_rows


def _arrow_format(source: Source) -> str | None:
    if source.kind == "arrow":
        return "arrow"
    if source.kind == "loader" and source.loader == "parquet" and not source.kwargs:
        return "parquet"
    return None


def walk(source: Source, index: int, start: int) -> Iterator[RowRef]:
    """Every row of ``source`` (the ``index``-th source) from row ``start`` on, undecoded.

    Raises:
        DataError: If the file cannot be read.
    """
    name = source.name
    if source.kind == "json":
        field = source.kwargs.get("field")
        document = json_document(Path(name), field)
        if document is not None:
            for row, value in enumerate(document[start:], start=start):
                text = json.dumps(value, ensure_ascii=False)
                yield RowRef(index, row, PARSED, (text, None, value))
            return
        row = 0
        try:
            with open(name, "rb") as stream:
                for number, raw in enumerate(stream, start=1):
                    if not is_row_line(raw, number):
                        continue
                    if row >= start:
                        yield RowRef(index, row, LINE, (number, raw))
                    row += 1
        except OSError as error:
            raise DataError(f"{name}: cannot read ({error})") from error
        return
    arrow = _arrow_format(source)
    if arrow is not None:
        for row in range(start, _open(source, arrow).num_rows):
            yield RowRef(index, row, LAZY)
        return
    yield from _walk_datasets(source, index, start)


def _walk_datasets(source: Source, index: int, start: int) -> Iterator[RowRef]:
    """Rows through ``datasets`` streaming: decoded here, on every rank."""
    import datasets

    why = None
    if source.kind == "hub":
        loader, files, split = source.loader, source.data_files, source.split
        why = hub_unreachable(loader)
    else:
        loader, files, split = source.loader, source.name, "train"
    try:
        stream = datasets.load_dataset(
            loader, data_files=files, split=split, streaming=True, **source.kwargs
        )
    except Exception as error:  # offline, unknown repo, bad file: one message
        raise DataError(
            f"{source.name}: cannot stream ({error})"
            + (f" ({why}: run once with network access to cache it)" if why else "")
        ) from error
    for offset, row in enumerate(stream.skip(start) if start else stream):
        yield RowRef(index, start + offset, PARSED, row)


class _ArrowRows:
    """A Parquet or Arrow file's rows, read by row range."""

    def __init__(self, source: Source, arrow: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.name = source.name
        try:
            if arrow == "parquet":
                self._parquet = pq.ParquetFile(self.name)
                sizes = [
                    self._parquet.metadata.row_group(group).num_rows
                    for group in range(self._parquet.metadata.num_row_groups)
                ]
                self._group_starts = [sum(sizes[:group]) for group in range(len(sizes) + 1)]
                self.num_rows = self._group_starts[-1]
            else:  # datasets' own cache format: an IPC stream (or file), memory-mapped
                mapped = pa.memory_map(self.name)
                try:
                    self._table = pa.ipc.open_stream(mapped).read_all()
                except pa.ArrowInvalid:
                    self._table = pa.ipc.open_file(mapped).read_all()
                self.num_rows = self._table.num_rows
        except (OSError, pa.ArrowException) as error:
            raise DataError(f"{self.name}: cannot read as {arrow} ({error})") from error

    def rows(self, first: int, last: int, count: DecodeCount) -> list[dict[str, Any]]:
        """Rows ``first`` to ``last`` (inclusive) as dicts, reading only what holds them."""
        import pyarrow as pa

        try:
            if hasattr(self, "_table"):
                table = self._table.slice(first, last - first + 1)
            else:
                starts = self._group_starts
                groups = [
                    group
                    for group in range(len(starts) - 1)
                    if starts[group] <= last and starts[group + 1] > first
                ]
                count.table_rows += starts[groups[-1] + 1] - starts[groups[0]]
                table = self._parquet.read_row_groups(groups)
                table = table.slice(first - starts[groups[0]], last - first + 1)
            if hasattr(self, "_table"):
                count.table_rows += last - first + 1
            return table.to_pylist()
        except (OSError, pa.ArrowException) as error:
            raise DataError(f"{self.name}: cannot read rows {first}-{last} ({error})") from error


_OPEN: dict[str, _ArrowRows] = {}


def _open(source: Source, arrow: str) -> _ArrowRows:
    """The file's reader, opened once per process (footer or record batches only)."""
    if source.name not in _OPEN:
        if len(_OPEN) >= 8:  # a stream walks its files in order: keep the last few open
            _OPEN.pop(next(iter(_OPEN)))
        _OPEN[source.name] = _ArrowRows(source, arrow)
    return _OPEN[source.name]


def decode(
    sources: list[Source], refs: list[RowRef], count: DecodeCount
) -> list[dict[str, list[Any]]]:
    """One-row ``TokenizeRows`` batches for ``refs``, in their order; adds to ``count``.

    JSON Lines are decoded line by line; Parquet and Arrow rows of one source are read as one
    range from the first to the last wanted row (a rank's share of a window is a contiguous
    run of the stream, so the range holds little else).

    Raises:
        DataError: If a file cannot be read.
    """
    batches: list[dict[str, list[Any]] | None] = [None] * len(refs)
    lazy = [(i, ref) for i, ref in enumerate(refs) if ref.kind == LAZY]
    lazy.sort(key=lambda pair: pair[1].source)
    for source, group in groupby(lazy, key=lambda pair: pair[1].source):
        wanted = list(group)
        first = min(ref.row for _, ref in wanted)
        last = max(ref.row for _, ref in wanted)
        reader = _open(sources[source], _arrow_format(sources[source]) or "")
        rows = reader.rows(first, last, count)
        for i, ref in wanted:
            batches[i] = {name: [value] for name, value in rows[ref.row - first].items()}
    for i, ref in enumerate(refs):
        count.rows += 1
        if ref.kind == LAZY:
            continue
        if ref.kind == LINE:
            number, raw = ref.payload
            count.json_bytes += len(raw)
            batches[i] = _json_batch(*parse_line(raw, number))
        elif sources[ref.source].kind == "json":
            batches[i] = _json_batch(*ref.payload)
        else:
            batches[i] = {name: [value] for name, value in ref.payload.items()}
    return batches  # type: ignore[return-value]


def _json_batch(text: str | None, line: int | None, row: Any) -> dict[str, list[Any]]:
    """A JSON row as ``TokenizeRows`` takes it, with the row already parsed."""
    return {
        JSON_TEXT: [text],
        JSON_LINE: [line],
        JSON_PROBLEM: [row if text is None else None],
        JSON_PARSED: [row if text is not None else None],
    }


def columns_of(batch: dict[str, list[Any]], json_rows: bool) -> list[str] | None:
    """The columns a row shows (its keys), or None for a JSON row that is not an object."""
    if not json_rows:
        return list(batch)
    row = batch[JSON_PARSED][0]
    return list(row) if isinstance(row, dict) else None
