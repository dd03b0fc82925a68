"""Load dataset rows from local json / jsonl / parquet / text / csv files or the Hugging Face hub.

Local files are loaded one at a time so that an error can name the file a bad row came from.
Parquet, text, csv, folders and the hub go through the ``datasets`` library. Local JSON and
JSON Lines are parsed with the ``json`` module instead: when a column mixes types, ``datasets``
stores it as a ``Json`` feature that decodes the string ``"42"`` to the integer ``42``
(measured with datasets 5.2), which would turn a valid row into a malformed one. Parsing them
directly keeps every value exactly as written and lets a broken line be reported as a row.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.errors import DataError

# Loader names of the ``datasets`` library that tunelab accepts as ``source``.
_LOADERS = ("json", "parquet", "text", "csv")
_SUFFIX_TO_LOADER = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
    ".csv": "csv",
}


@dataclass
class RowSource:
    """Rows of one file (or one hub split), with the name errors use for it.

    Attributes:
        name: The file path, or ``repo_id[split]`` for a hub dataset.
        rows: The rows, as dicts of column name to value.
        columns: The column names.
    """

    name: str
    rows: Any
    columns: list[str]


def _quiet_load(*args: Any, **kwargs: Any) -> Any:
    """``datasets.load_dataset`` without its progress bars (they interleave across ranks)."""
    import datasets  # imported lazily: it is slow to import and only datasets need it

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(*args, **kwargs)
    finally:
        if enabled:
            datasets.enable_progress_bars()


def _as_file_list(data_files: Any, split: str) -> list[str]:
    if isinstance(data_files, dict):
        if split not in data_files:
            raise DataError(f"data_files has no split {split!r} (has: {', '.join(data_files)})")
        data_files = data_files[split]
    if isinstance(data_files, (str, Path)):
        return [str(data_files)]
    return [str(f) for f in data_files]


@dataclass(frozen=True)
class InvalidRow:
    """A row that could not be parsed at all (e.g. a broken JSON line)."""

    problem: str


def _read_json(file: str, field: str | None) -> RowSource:
    text = Path(file).read_text(encoding="utf-8")
    rows: list[Any]
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None  # not one JSON document: JSON Lines
    if data is not None and not isinstance(data, (str, int, float)):
        if field is not None:
            if not isinstance(data, dict) or field not in data:
                raise DataError(f"{file}: no top-level field {field!r}")
            data = data[field]
        rows = data if isinstance(data, list) else [data]
    else:
        rows = []
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                rows.append(InvalidRow(f"not valid JSON ({error.msg} at column {error.colno})"))
    columns = list(dict.fromkeys(k for row in rows if isinstance(row, dict) for k in row))
    return RowSource(file, rows, columns)


def _load_file(loader: str, file: str, **kwargs: Any) -> RowSource:
    if not Path(file).is_file():
        raise DataError(f"data file not found: {file}")
    if loader == "json" and set(kwargs) <= {"field"}:
        return _read_json(file, kwargs.get("field"))
    try:
        dataset = _quiet_load(loader, data_files=file, split="train", **kwargs)
    except Exception as error:  # pyarrow and datasets raise many types for one bad file
        raise DataError(f"{file}: cannot read as {loader} ({error})") from error
    return RowSource(file, dataset, list(dataset.column_names))


def load_sources(
    source: str, data_files: Any = None, split: str = "train", **load_dataset_kwargs: Any
) -> list[RowSource]:
    """Load the rows that a dataset builder reads.

    Args:
        source: ``"json"``, ``"parquet"``, ``"text"`` or ``"csv"`` with ``data_files``; a local
            file whose suffix decides the format (``.json``, ``.jsonl``, ``.parquet``,
            ``.txt``, ``.csv``); a local folder; or a hub dataset id.
        data_files: File path(s) for a loader ``source`` (a string, a list, or a dict of split
            name to paths).
        split: The split to read from a hub dataset or folder (or a key of ``data_files``).
        **load_dataset_kwargs: Passed to ``datasets.load_dataset`` (e.g. ``name``,
            ``revision``).

    Returns:
        One ``RowSource`` per file, in order (a single one for the hub or a folder).

    Raises:
        DataError: If a file is missing or unreadable, or the hub dataset cannot be loaded.
    """
    if source in _LOADERS:
        if data_files is None:
            raise DataError(f"source {source!r} needs data_files (the path of the file)")
        files = _as_file_list(data_files, split)
        return [_load_file(source, file, **load_dataset_kwargs) for file in files]
    path = Path(source)
    if path.suffix.lower() in _SUFFIX_TO_LOADER:
        return [_load_file(_SUFFIX_TO_LOADER[path.suffix.lower()], source, **load_dataset_kwargs)]
    if path.is_dir():
        name = f"{source}[{split}]"
    elif source.startswith((".", "/", "~")):
        raise DataError(f"data source not found: {source}")
    else:
        name = f"{source} (hub)[{split}]"
    try:
        dataset = _quiet_load(source, data_files=data_files, split=split, **load_dataset_kwargs)
    except Exception as error:  # offline, unknown repo, bad split: all one message to the user
        raise DataError(f"cannot load dataset {source!r} split {split!r}: {error}") from error
    return [RowSource(name, dataset, list(dataset.column_names))]


def iter_rows(sources: list[RowSource]) -> Iterator[tuple[RowSource, int, dict[str, Any]]]:
    """Yield ``(source, row_index, row)``; the index is 0-based within its source."""
    for source in sources:
        for index, row in enumerate(source.rows):
            yield source, index, row
