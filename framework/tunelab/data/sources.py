"""Where dataset rows come from: local json / jsonl / parquet / text / csv / arrow files, or the hub.

A ``Source`` is one file (or one hub split). Resolving sources is cheap and happens on every
rank (a missing file is an error everywhere at once); reading them is for the process that
tokenizes (see ``tunelab.data.cache``), which turns each into an Arrow-backed
``datasets.Dataset``:

- Parquet, text, csv, folders and hub datasets go through ``datasets.load_dataset`` and its
  cache. Arrow files (``.arrow``, the format of ``datasets``' own cache) are memory-mapped
  where they lie with ``Dataset.from_file``.
- Local JSON and JSON Lines are parsed with the ``json`` module instead. When a column mixes
  types, ``datasets`` stores it as a ``Json`` feature that decodes the string ``"42"`` to the
  integer ``42`` (measured with datasets 5.2), which would turn a valid row into a malformed
  one. So each row is stored as its own JSON text in a string column (one explicit schema,
  whatever the rows hold) and decoded again by the tokenizing function: values stay exactly
  as written. A line that is not UTF-8 or not JSON is kept as a malformed row with its line
  number, so errors name ``file:line`` (``read_json`` below).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab._hub import offline_unless_hub_answers
from tunelab._json_lines import json_rows
from tunelab.errors import DataError

# Loader names of the ``datasets`` library that tunelab accepts as ``source`` (the config
# rules keep a copy; a unit test keeps them equal).
_LOADERS = ("json", "parquet", "text", "csv")
_SUFFIX_TO_LOADER = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
    ".csv": "csv",
}
# Not a loader: an Arrow file is memory-mapped in place rather than copied into the cache.
ARROW_SUFFIX = ".arrow"


@dataclass
class RawRows:
    """A source's rows as an Arrow-backed dataset, ready to be tokenized.

    Attributes:
        dataset: The rows. For JSON files, the columns ``_json`` (the row's JSON text, or
            None), ``_line`` (1-based line in the file, or None inside one JSON document) and
            ``_problem`` (why the line is not a row, or None); otherwise the file's columns.
        columns: The row columns: for JSON, every key found in any row, in order of first
            appearance.
        json_rows: Whether ``dataset`` holds JSON text to decode.
        has_objects: Whether any row is an object; when none is (every line broken, say),
            each row is malformed by itself and no column is looked for.
    """

    dataset: Any
    columns: list[str]
    json_rows: bool
    has_objects: bool = True


@dataclass
class Source:
    """One file or hub split of a dataset.

    Attributes:
        name: What errors call it: the file path, or ``repo_id[split]`` for a hub dataset.
        kind: ``"json"`` (read with the ``json`` module), ``"loader"`` (a local file through
            a ``datasets`` loader), ``"arrow"`` (an Arrow file, memory-mapped) or ``"hub"``
            (a hub dataset id or a local folder, through ``datasets.load_dataset``).
        loader: The ``datasets`` loader of a ``"loader"`` file; for ``"hub"`` the dataset
            id or folder.
        split: The split of a hub dataset or folder.
        data_files: ``data_files`` for a hub dataset or folder.
        kwargs: Extra ``datasets.load_dataset`` arguments (for JSON only ``field``).
    """

    name: str
    kind: str
    loader: str = ""
    split: str = "train"
    data_files: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    _loaded: Any = field(default=None, repr=False)

    def fingerprint(self) -> str:
        """What identifies these rows for the tokenized cache.

        A local file by its resolved path, size and modification time (as ``datasets`` keys
        its own caches), so the key costs no read; a hub dataset or folder by the fingerprint
        ``datasets`` gives the loaded split (its cache files, hence its revision).

        Raises:
            DataError: If a hub dataset cannot be loaded.
        """
        if self.kind == "hub":
            return f"hub:{self._load_hub()._fingerprint}"
        stat = os.stat(self.name)
        where = str(Path(self.name).resolve())
        options = json.dumps(self.kwargs, sort_keys=True, default=str)
        return f"{self.kind}:{self.loader}:{where}:{stat.st_size}:{stat.st_mtime_ns}:{options}"

    def read(self, scratch: Path) -> RawRows:
        """Read the rows (on the tokenizing process only).

        Args:
            scratch: Where a JSON source writes the Arrow file it is read into (a private
                path the caller deletes once the rows are tokenized).

        Raises:
            DataError: If the file cannot be read in its format.
        """
        from datasets import Dataset  # imported lazily: slow to import, needed only here

        if self.kind == "json":
            columns, has_objects = read_json(Path(self.name), self.kwargs.get("field"), scratch)
            return RawRows(Dataset.from_file(str(scratch)), columns, True, has_objects)
        if self.kind == "arrow":
            try:
                dataset = Dataset.from_file(self.name)
            except Exception as error:  # pyarrow raises many types for one bad file
                raise DataError(f"{self.name}: cannot read as an Arrow file ({error})") from error
        elif self.kind == "loader":
            try:
                dataset = _quiet_load(
                    self.loader, data_files=self.name, split="train", **self.kwargs
                )
            except Exception as error:  # pyarrow and datasets raise many types for one bad file
                raise DataError(f"{self.name}: cannot read as {self.loader} ({error})") from error
        else:
            dataset = self._load_hub()
        return RawRows(dataset, list(dataset.column_names), json_rows=False)

    def _load_hub(self) -> Any:
        if self._loaded is None:
            why = hub_unreachable(self.loader)
            try:
                self._loaded = _quiet_load(
                    self.loader, data_files=self.data_files, split=self.split, **self.kwargs
                )
            except Exception as error:  # offline, unknown repo, bad split: one message
                raise DataError(
                    f"cannot load dataset {self.loader!r} split {self.split!r}: {error}"
                    + (f" ({why}: run once with network access to cache it)" if why else "")
                ) from error
        return self._loaded


def hub_unreachable(loader: str) -> str | None:
    """For a hub dataset id: offline mode at once if the hub cannot be reached (and why).

    Without it an unreachable hub costs about 25 s of retries per load, a line each
    (``tunelab._hub``). A local folder never asks.
    """
    if Path(loader).expanduser().is_dir():
        return None
    return offline_unless_hub_answers()


def _quiet_load(*args: Any, **kwargs: Any) -> Any:
    """``datasets.load_dataset`` without its progress bars (they interleave across ranks)."""
    import datasets

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


def _file_source(loader: str, file: str, kwargs: dict[str, Any]) -> Source:
    if not Path(file).is_file():
        raise DataError(f"data file not found: {file}")
    if loader == "json" and set(kwargs) <= {"field"}:
        return Source(file, "json", loader, kwargs=kwargs)
    if loader == "arrow":
        if kwargs:
            raise DataError(f"{file}: an Arrow file takes no loader options ({', '.join(kwargs)})")
        return Source(file, "arrow", loader)
    return Source(file, "loader", loader, kwargs=kwargs)


def resolve_sources(
    source: str, data_files: Any = None, split: str = "train", **load_dataset_kwargs: Any
) -> list[Source]:
    """The sources a dataset builder reads, checked to exist but not read.

    Args:
        source: ``"json"``, ``"parquet"``, ``"text"`` or ``"csv"`` with ``data_files``; a local
            file whose suffix decides the format (``.json``, ``.jsonl``, ``.parquet``,
            ``.txt``, ``.csv``, ``.arrow``); a local folder; or a hub dataset id.
        data_files: File path(s) for a loader ``source`` (a string, a list, or a dict of split
            name to paths).
        split: The split to read from a hub dataset or folder (or a key of ``data_files``).
        **load_dataset_kwargs: Passed to ``datasets.load_dataset`` (e.g. ``name``,
            ``revision``).

    Returns:
        One ``Source`` per file, in order (a single one for the hub or a folder).

    Raises:
        DataError: If a local file or folder is missing.
    """
    if source in _LOADERS:
        if data_files is None:
            raise DataError(f"source {source!r} needs data_files (the path of the file)")
        files = _as_file_list(data_files, split)
        return [_file_source(_loader_of(file, source), file, load_dataset_kwargs) for file in files]
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix in _SUFFIX_TO_LOADER or suffix == ARROW_SUFFIX:
        return [_file_source(_loader_of(source, None), source, load_dataset_kwargs)]
    if path.is_dir():
        name = f"{source}[{split}]"
    elif source.startswith((".", "/", "~")):
        raise DataError(f"data source not found: {source}")
    else:
        name = f"{source} (hub)[{split}]"
    return [Source(name, "hub", source, split, data_files, load_dataset_kwargs)]


def expand_folders(sources: list[Source]) -> list[Source]:
    """``sources`` with each local folder replaced by its data files, sorted by path.

    A stream's position counts files and rows, so a folder must be a fixed list of files (the
    hub ids stay one source each, read through ``datasets`` streaming).

    Raises:
        DataError: If a folder holds no data file.
    """
    expanded = []
    for source in sources:
        folder = Path(source.loader)
        if source.kind != "hub" or not folder.is_dir():
            expanded.append(source)
            continue
        suffixes = (*_SUFFIX_TO_LOADER, ARROW_SUFFIX)
        files = sorted(str(f) for f in folder.rglob("*") if f.suffix.lower() in suffixes)
        if not files:
            raise DataError(f"{source.name}: no data file ({', '.join(suffixes)}) in the folder")
        expanded += [_file_source(_loader_of(file, None), file, source.kwargs) for file in files]
    return expanded


def _loader_of(file: str, loader: str | None) -> str:
    """The loader of ``file``: its suffix's for an Arrow file, else the one given or implied."""
    suffix = Path(file).suffix.lower()
    if suffix == ARROW_SUFFIX:
        return "arrow"
    return loader or _SUFFIX_TO_LOADER[suffix]


# Columns of the table a JSON file is read into.
JSON_TEXT, JSON_LINE, JSON_PROBLEM = "_json", "_line", "_problem"
# A stream's JSON batches also carry the row it has parsed already (not stored in a table).
JSON_PARSED = "_parsed"
# Rows per Arrow record batch while reading: bounds the reader's memory, not the file's.
_BATCH_ROWS = 8192


def read_json(file: Path, field: str | None, target: Path) -> tuple[list[str], bool]:
    """Write the rows of a JSON / JSON Lines file to an Arrow file; return its columns.

    Args:
        file: The file.
        field: For a JSON document that is an object, the key holding the rows.
        target: The Arrow (IPC stream) file to write, with the ``RawRows`` JSON schema.

    Returns:
        Every key of any row, in order of first appearance; whether any row is an object.

    Raises:
        DataError: If ``field`` names no top-level key, or the file cannot be read.
    """
    import pyarrow as pa

    schema = pa.schema(
        [(JSON_TEXT, pa.large_string()), (JSON_LINE, pa.int64()), (JSON_PROBLEM, pa.string())]
    )
    columns: dict[str, None] = {}
    has_objects = False
    texts: list[str | None] = []
    lines: list[int | None] = []
    problems: list[str | None] = []

    def flush() -> None:
        writer.write_batch(pa.record_batch([texts, lines, problems], schema=schema))
        texts.clear(), lines.clear(), problems.clear()

    try:
        with pa.OSFile(str(target), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for text, line, row in json_rows(file, field):
                texts.append(text)
                lines.append(line)
                problems.append(row if text is None else None)
                if isinstance(row, dict) and text is not None:
                    columns.update(dict.fromkeys(row))
                    has_objects = True
                if len(texts) >= _BATCH_ROWS:
                    flush()
            if texts:
                flush()
    except OSError as error:
        raise DataError(f"{file}: cannot read ({error})") from error
    return list(columns), has_objects
