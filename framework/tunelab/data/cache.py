"""Tokenize once per machine, into the ``datasets`` cache; every rank memory-maps the result.

On each machine, local rank 0 (the leader) computes a fingerprint of everything that decides
the samples: the sources (a local file by path, size and modification time; a hub split by its
``datasets`` fingerprint), the tokenizer (``Tokenizer.fingerprint``: its serialized
``tokenizer.json``, special ids and chat template), the builder and every argument that
changes the result, and the versions of the libraries that render and tokenize. If
``{cache_root}/{fingerprint}/`` holds a finished table it is reused; otherwise the leader reads
the rows and tokenizes them with ``Dataset.map`` in ``num_proc`` worker processes, into a
private folder that is renamed into place once complete (so a crash, or a second machine
sharing the cache folder, never sees a partial table).

The other local ranks do no reading and no tokenizing: they wait in one collective on the
default process group (an ``all_gather_object``, which is a barrier that also carries each
leader's result: the cache folder, or its error, which every rank then raises alike). No rank
polls files. Then every rank memory-maps the same Arrow files: the pages are shared through the
page cache, and samples are read from them lazily.

Without a process group every process is its own leader (the rename keeps concurrent builds
of one fingerprint safe).

The tokenizing pass: source rows to Arrow rows of samples, one per sample or malformed row.

``Dataset.map`` calls ``TokenizeRows`` on batches of a source's rows (in ``num_proc`` worker
processes when the source is large). A row becomes zero or more samples (a chat template may
give one sample per assistant turn); a malformed row becomes one row whose ``problem`` says
what is wrong with it, so that raising or skipping (``skip_malformed``) is decided when the
cached table is opened, and the cache serves both.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from tunelab import errors
from tunelab.data.rows import BadRow, cut_long_text
from tunelab.data.sources import JSON_LINE, JSON_PARSED, JSON_PROBLEM, JSON_TEXT, Source
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import DataError, TunelabError

# The token columns of each kind of sample.
SAMPLE_COLUMNS = {
    "sft": ("tokens", "labels"),
    "preference": ("chosen_tokens", "chosen_labels", "rejected_tokens", "rejected_labels"),
    # Pairs with a reward model's per-pair margin, ``[margin]`` (float64).
    "preference_margin": (
        "chosen_tokens",
        "chosen_labels",
        "rejected_tokens",
        "rejected_labels",
        "margin",
    ),  # fmt: skip
    # KTO's labelled completions; ``desirable`` is ``[1]`` or ``[0]`` (a list like the others).
    "unpaired": ("tokens", "labels", "desirable"),
    # Chat samples with images: each image's file and patch grid (``tunelab.data.image_rows``).
    # Videos (``tunelab.data.video_rows``): each one's frame files joined by newlines, its grid
    # and seconds per frame pair.
    "sft_images": (
        "tokens",
        "labels",
        "images",
        "image_grids",
        "videos",
        "video_grids",
        "video_seconds",
    ),
    # Preference pairs whose prompt holds images, shared by both sides (``image_preference``).
    "preference_images": (
        "chosen_tokens",
        "chosen_labels",
        "rejected_tokens",
        "rejected_labels",
        "images",
        "image_grids",
    ),
}
# Columns of another type than a list of int32.
_COLUMN_TYPES = {
    "margin": "float64",
    "images": "string",
    "image_grids": "grids",
    "videos": "string",
    "video_grids": "grids",
    "video_seconds": "float64",
}
# Per row of the table: was it cut to max_seq_len, does it keep a trained token on every side
# (preference pairs), and where it came from. ``problem`` and ``column`` are set for a
# malformed row only.
_BOOKKEEPING = ("truncated", "completion", "problem", "column", "source", "row", "line")


class RowFunction(Protocol):
    """Turns one row (column name to value) into samples; a builder makes one per source."""

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Return the row's samples.

        Each is a dict of the kind's token columns plus ``truncated`` (bool) and, for
        preference pairs, ``completion`` (bool).

        Raises:
            BadRow: If the row cannot become a sample.
        """


def features(kind: str) -> Any:
    """The ``datasets.Features`` of a tokenized table of ``kind`` (``sft`` or ``preference``)."""
    from datasets import Features, Sequence, Value

    # int32 ids: every vocabulary fits, and the labels' -100; half the bytes of int64.
    def column(name: str) -> Any:
        kind_of = _COLUMN_TYPES.get(name, "int32")
        if kind_of == "grids":
            return Sequence(Sequence(Value("int32")))
        return Sequence(Value(kind_of))

    columns = {name: column(name) for name in SAMPLE_COLUMNS[kind]}
    columns.update(
        truncated=Value("bool"),
        completion=Value("bool"),
        problem=Value("string"),
        column=Value("string"),
        source=Value("int32"),
        row=Value("int64"),
        line=Value("int64"),
    )
    return Features(columns)


@dataclass
class TokenizeRows:
    """The batched ``Dataset.map`` function of one source (pickled to the worker processes).

    Attributes:
        rows: The builder's row function for this source.
        kind: ``sft`` or ``preference``.
        source: The source's index among the dataset's sources.
        json_rows: Whether the batch holds JSON text (``sources.read_json``) to decode.
        max_chars: Strings of a row are cut to this many characters before the row function
            sees them (``rows.text_bound``: past it no character reaches a sample); None
            cuts nothing.
    """

    rows: RowFunction
    kind: str
    source: int
    json_rows: bool
    max_chars: int | None = None

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        """Tokenize a batch of rows; ``indices`` are their 0-based positions in the source."""
        out: dict[str, list[Any]] = {
            name: [] for name in (*SAMPLE_COLUMNS[self.kind], *_BOOKKEEPING)
        }
        names = list(batch)
        for position, index in enumerate(indices):
            line = batch[JSON_LINE][position] if self.json_rows else None
            try:
                row = cut_long_text(self._row(batch, names, position), self.max_chars)
                samples = self.rows(row)
            except BadRow as bad:
                empty = dict.fromkeys(SAMPLE_COLUMNS[self.kind], [])
                self._append(out, empty, False, False, bad.problem, bad.column, index, line)
                continue
            for sample in samples:
                completion = sample.get("completion", True)
                self._append(out, sample, sample["truncated"], completion, None, None, index, line)
        return out

    def _row(self, batch: dict[str, list[Any]], names: list[str], position: int) -> Any:
        if not self.json_rows:
            return {name: batch[name][position] for name in names}
        problem = batch[JSON_PROBLEM][position]
        if problem is not None:
            raise BadRow("(whole row)", problem)
        if JSON_PARSED in batch:  # a stream's row, parsed once when its columns were read
            row = batch[JSON_PARSED][position]
        else:
            row = json.loads(batch[JSON_TEXT][position])
        if not isinstance(row, dict):
            raise BadRow("(whole row)", f"expected an object, got {type(row).__name__}")
        return row

    def _append(
        self,
        out: dict[str, list[Any]],
        sample: dict[str, Any],
        truncated: bool,
        completion: bool,
        problem: str | None,
        column: str | None,
        index: int,
        line: int | None,
    ) -> None:
        for name in SAMPLE_COLUMNS[self.kind]:
            out[name].append(sample[name])
        values = (truncated, completion, problem, column, self.source, index, line)
        for name, value in zip(_BOOKKEEPING, values):
            out[name].append(value)


logger = logging.getLogger(__name__)

# Bump when the table's layout or the tokenizing code changes what a fingerprint stands for.
# 2: one sample per conversation unless a turn is shown otherwise; tool rows. 3: preference
# rows with tool calls and reasoning (cached as malformed before). 4: tool calls checked
# against the row's declared tools (cached as samples before). 5: images named by URL or
# inline (cached as malformed before).
CACHE_FORMAT = 5
_MANIFEST = "tunelab_tokenized.json"
RETRIED = "(not cached: the next run tries again)"
"""How the problem of a malformed row ends when it may pass (an image URL that did not answer):
a table holding such a row is used by this run and built again by the next."""
# A worker process costs a fork and a pickled tokenizer: below this many rows per worker,
# tokenizing in the leader itself is faster.
MIN_ROWS_PER_WORKER = 5000


def default_num_proc() -> int:
    """``min(8, cpu count)``: the default number of tokenizing workers."""
    return min(8, os.cpu_count() or 1)


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """``cache_dir``, or ``tunelab/`` under the ``datasets`` cache (``HF_DATASETS_CACHE``)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return _datasets_cache() / "tunelab"


def _datasets_cache() -> Path:
    """``datasets.config.HF_DATASETS_CACHE``, without importing ``datasets`` to learn it.

    Importing ``datasets`` (and pandas with it) costs every rank of every run about 0.7
    CPU-seconds, and opening a cached table needs only pyarrow. Once ``datasets`` is imported
    its setting is the one in force (a program may change it); before, it is what ``datasets``
    will compute from the same environment variables.
    """
    loaded = sys.modules.get("datasets")
    if loaded is not None:
        return Path(loaded.config.HF_DATASETS_CACHE)
    xdg_cache = os.getenv("XDG_CACHE_HOME", "~/.cache")
    hf_home = os.path.expanduser(os.getenv("HF_HOME", os.path.join(xdg_cache, "huggingface")))
    return Path(os.getenv("HF_DATASETS_CACHE", os.path.join(hf_home, "datasets")))


def _versions() -> dict[str, str]:
    import jinja2
    import tokenizers

    return {"tokenizers": tokenizers.__version__, "jinja2": jinja2.__version__}


def fingerprint(
    builder: str, settings: dict[str, Any], tokenizer: Tokenizer, sources: list[Source]
) -> str:
    """The cache key of a tokenized dataset (see the module docstring)."""
    state = {
        "format": CACHE_FORMAT,
        "builder": builder,
        "settings": settings,
        "tokenizer": tokenizer.fingerprint,
        "sources": [source.fingerprint() for source in sources],
        "versions": _versions(),
    }
    text = json.dumps(state, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def tokenized_table(
    *,
    builder: str,
    kind: str,
    settings: dict[str, Any],
    tokenizer: Tokenizer,
    sources: list[Source],
    rows_for: Callable[[str, list[str]], RowFunction],
    num_proc: int | None,
    cache_dir: str | os.PathLike | None,
) -> Any:
    """The tokenized table of ``sources``, built once per machine and memory-mapped by all.

    Every rank of the default process group calls this, in the same order.

    Args:
        builder: The builder's name (part of the fingerprint).
        kind: ``sft`` or ``preference``.
        settings: Every builder argument that changes the samples, JSON-able.
        tokenizer: The tokenizer.
        sources: The resolved sources.
        rows_for: Called by the leader with a source's name and columns; returns the picklable
            function that turns its rows into samples (raises ``DataError`` for a source
            without the columns it needs).
        num_proc: Tokenizing worker processes (None: ``min(8, cpu count)``).
        cache_dir: Root of the cache (None: ``cache_root``'s default).

    Returns:
        The memory-mapped table, with the ``features(kind)`` columns.

    Raises:
        DataError: If a source cannot be read or has no usable layout (on every rank).
        ConfigError: If ``num_proc`` is not positive.
    """
    if num_proc is not None and num_proc < 1:
        raise errors.ConfigError(f"num_proc must be at least 1, got {num_proc}")
    root = cache_root(cache_dir)
    leader, node = _role()
    failure: BaseException | None = None
    result: tuple[str, ...] | None = None
    if leader:
        try:
            key = fingerprint(builder, settings, tokenizer, sources)
            target = root / key
            if not _finished(target):
                workers = num_proc or default_num_proc()
                _build(target, kind, sources, rows_for, workers)
            result = ("ok", str(target))
        except Exception as error:  # reported to the other ranks, then raised here
            failure = error
            result = ("error", *_describe(error))
    result = _share(node, result)
    if failure is not None:
        raise failure
    if result[0] == "error":
        # The leader's own error, so that every rank stops with the same one line.
        raise getattr(errors, result[1])(result[2])
    return _open(Path(result[1]), kind)


def _describe(error: Exception) -> tuple[str, str]:
    """``(name of a tunelab.errors class, message)`` for the other ranks to raise."""
    if isinstance(error, TunelabError):
        for kind in type(error).__mro__:  # e.g. ChatTemplateError travels as a DataError
            if getattr(errors, kind.__name__, None) is kind:
                return kind.__name__, str(error)
    return "DataError", (
        f"local rank 0 failed to prepare the dataset: {type(error).__name__}: {error}"
    )


def _role() -> tuple[bool, str]:
    """Whether this process tokenizes for its machine, and the machine's name."""
    if not (dist.is_available() and dist.is_initialized()):
        return True, ""
    node = os.environ.get("GROUP_RANK") or socket.gethostname()
    return int(os.environ.get("LOCAL_RANK", "0")) == 0, node


def _share(node: str, result: tuple[str, ...] | None) -> tuple[str, ...]:
    """Every rank gets its machine leader's result (a collective: the ranks' barrier)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        assert result is not None, "without a group every process leads"
        return result
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (node, result))
    for other_node, other in everyone:
        if other_node == node and other is not None:
            return other
    raise DataError(f"no local rank 0 on machine {node!r} prepared the dataset")


def _build(
    target: Path,
    kind: str,
    sources: list[Source],
    rows_for: Callable[[str, list[str]], RowFunction],
    num_proc: int,
) -> None:
    """Tokenize every source into a private folder, then rename it to ``target``."""
    import datasets

    target.parent.mkdir(parents=True, exist_ok=True)
    work = target.parent / f".{target.name}.{socket.gethostname()}.{os.getpid()}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # bars of several machines would interleave
    try:
        files: list[str] = []
        retry = False
        for index, source in enumerate(sources):
            scratch = work / f"raw-{index}.arrow"
            raw = source.read(scratch)
            if len(raw.dataset) == 0:
                continue
            # Without a single object row there is no layout to find: every row is
            # malformed by itself, and the function is never called.
            rows = rows_for(source.name, raw.columns) if raw.has_objects else _no_rows
            workers = max(1, min(num_proc, len(raw.dataset) // MIN_ROWS_PER_WORKER))
            logger.info(
                "tokenizing %d rows of %s with %d process(es)",
                len(raw.dataset),
                source.name,
                workers,
            )
            table = raw.dataset.map(
                TokenizeRows(rows, kind, index, raw.json_rows, getattr(rows, "max_chars", None)),
                batched=True,
                with_indices=True,
                remove_columns=raw.dataset.column_names,
                features=features(kind),
                num_proc=workers if workers > 1 else None,
                cache_file_name=str(work / f"source-{index}.arrow"),
                load_from_cache_file=False,
                new_fingerprint=f"{target.name}-{index}",
            )
            files += [Path(entry["filename"]).name for entry in table.cache_files]
            retry = retry or _has_retried_rows(table)
            del raw, table
            scratch.unlink(missing_ok=True)
        manifest = {"format": CACHE_FORMAT, "kind": kind, "files": files, "retry": retry}
        (work / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _publish(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if enabled:
            datasets.enable_progress_bars()


def _no_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    raise AssertionError("a source without object rows has no row function")


def _has_retried_rows(table: Any) -> bool:
    """Whether a tokenized ``datasets.Dataset`` holds a row whose problem may pass (``RETRIED``)."""
    import pyarrow.compute as pc

    return bool(pc.any(pc.ends_with(table.data.column("problem"), RETRIED)).as_py())


def _finished(target: Path) -> bool:
    """Whether ``target`` holds a finished table to reuse: a manifest, no ``RETRIED`` rows.

    An unreadable manifest counts as finished: opening it says so (``_open``).
    """
    path = target / _MANIFEST
    if not path.is_file():
        return False
    try:
        return not json.loads(path.read_text()).get("retry", False)
    except (OSError, ValueError, AttributeError):
        return True


def _publish(work: Path, target: Path) -> None:
    """Rename ``work`` to ``target``; another process's finished ``target`` wins."""
    try:
        os.rename(work, target)
    except OSError:
        if _finished(target):
            return  # another machine (or run) finished the same table first
        # A leftover without a manifest was never finished, one with retried rows is stale:
        # replace it.
        stale = target.parent / f".{target.name}.stale-{uuid.uuid4().hex[:8]}"
        os.rename(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(work, target)


def _open(folder: Path, kind: str) -> MappedTable:
    """Memory-map the table in ``folder``."""
    import pyarrow as pa

    try:
        manifest = json.loads((folder / _MANIFEST).read_text())
        return MappedTable([folder / name for name in manifest["files"]], kind)
    except (OSError, ValueError, KeyError, pa.ArrowException) as error:
        raise DataError(
            f"tokenized dataset cache {folder} is unreadable ({error}); delete the folder"
        ) from error


class MappedTable:
    """A tokenized table's Arrow files, memory-mapped, read a row at a time.

    The part of ``datasets.Dataset.from_file`` that the tokenized datasets use (rows as dicts
    of Python values, the Arrow table, its files), with pyarrow alone: every rank of every run
    opens one, and importing ``datasets`` for it cost each about 0.7 CPU-seconds.

    Attributes:
        data: The ``pyarrow.Table`` (zero-copy over the mapped files).
        cache_files: ``{"filename": path}`` for each file, as ``datasets`` lists them.
    """

    def __init__(self, files: list[Path], kind: str, columns: list[str] | None = None) -> None:
        """Map ``files`` (Arrow IPC streams, ``datasets``' cache format) as one table.

        Args:
            files: The table's parts, in order; none makes an empty table of ``kind``.
            kind: The sample kind (``SAMPLE_COLUMNS``), for an empty table's columns.
            columns: Keep these columns only (None: all).
        """
        import pyarrow as pa

        self._files, self._kind, self._columns = list(files), kind, columns
        if self._files:
            parts = [pa.ipc.open_stream(pa.memory_map(str(path))).read_all() for path in files]
            table = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        else:
            table = features(kind).arrow_schema.empty_table()
        self.data = table if columns is None else table.select(columns)
        self.cache_files = [{"filename": str(path)} for path in self._files]

    def __len__(self) -> int:
        """Number of rows."""
        return self.data.num_rows

    def __getitem__(self, row: int) -> dict[str, Any]:
        """Row ``row`` as column name to Python value."""
        return self.data.slice(row, 1).to_pylist()[0]

    def select_columns(self, columns: list[str]) -> MappedTable:
        """The same files with ``columns`` only."""
        return MappedTable(self._files, self._kind, columns)

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy in another process maps the files again instead of pickling their bytes.
        return MappedTable, (self._files, self._kind, self._columns)


def malformed_message(table: Any, row: int, source_names: list[str]) -> str:
    """What a malformed row's error says: ``file:line: row N (0-based), column: why``."""
    record = table[row]
    return describe_malformed(
        source_names[record["source"]],
        record["line"],
        record["row"],
        record["column"],
        record["problem"],
    )


def describe_malformed(
    name: str, line: int | None, row: int, column: str | None, problem: str
) -> str:
    """``file:line: row N (0-based), column 'c': why (set skip_malformed: true ...)``.

    Args:
        name: The source's name (its file, or a hub split).
        line: The row's 1-based line in a JSON file, or None.
        row: The row's 0-based position in its source.
        column: The column at fault (``(whole row)`` when it is the row itself).
        problem: What is wrong.
    """
    where = f"{name}:{line}" if line is not None else name
    return (
        f"{where}: row {row} (0-based), column {column!r}: {problem} "
        "(set skip_malformed: true to skip such rows)"
    )
