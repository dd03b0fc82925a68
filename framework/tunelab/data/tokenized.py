"""``TokenizedDataset``: samples read lazily from a memory-mapped, tokenized Arrow table.

The table (``tunelab.data.cache``) holds one row per sample and one per malformed source row.
Opening it decides what a run uses: the first malformed row is raised (or, with
``skip_malformed``, every one is counted and skipped), preference pairs left without a trained
token are dropped, and packs are laid out. What the dataset keeps in memory is a few integers
per sample (the rows it uses, and where each pack starts), never the token lists: an item is
read from the table when asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from tunelab.data.cache import SAMPLE_COLUMNS, RowFunction, malformed_message, tokenized_table
from tunelab.data.packing import pack_samples
from tunelab.data.rows import IGNORE_INDEX
from tunelab.data.sources import Source, expand_folders
from tunelab.data.streaming import DEFAULT_SHUFFLE_BUFFER, StreamingDataset
from tunelab.data.tokenizer import UNKNOWN_CHECK_SAMPLES, Tokenizer, check_tokens_fit
from tunelab.errors import ConfigError, DataError


def _flags(table: Any, column: str) -> np.ndarray:
    import pyarrow.compute as pc

    values = table.data.column(column)
    if column == "problem":
        values = pc.is_valid(values)
    return _to_numpy(values, np.bool_)


def _list_lengths(values: Any) -> np.ndarray:
    """The length of each list of a pyarrow list column (0 for a null)."""
    import pyarrow.compute as pc

    return _to_numpy(pc.list_value_length(values), np.int32)


def _to_numpy(values: Any, dtype: type) -> np.ndarray:
    """A pyarrow (chunked) array of bools or int32 as numpy, a null as False or 0.

    Read from the Arrow buffers: pyarrow's own ``to_numpy`` imports pandas, which cost every
    rank of every run about 0.4 CPU-seconds.
    """
    import pyarrow as pa

    parts = [np.zeros(0, dtype)]
    for chunk in getattr(values, "chunks", [values]):
        if len(chunk) == 0:
            continue
        if dtype is np.bool_:
            chunk = chunk.cast(pa.uint8())  # Arrow packs bools into bits
        validity, data = chunk.buffers()[:2]
        width = np.dtype(dtype).itemsize
        part = np.frombuffer(data, np.dtype(dtype), len(chunk), chunk.offset * width)
        if chunk.null_count:
            bits = np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")
            part = np.where(bits[chunk.offset : chunk.offset + len(chunk)], part, 0).astype(dtype)
        parts.append(part)
    return np.concatenate(parts)


def pack_starts(lengths: np.ndarray, max_seq_len: int) -> np.ndarray:
    """Where each pack starts, greedily in order (``pack_samples``' rule), plus the end.

    Args:
        lengths: Token count of every sample, each in ``[1, max_seq_len]``.
        max_seq_len: Length of a pack.

    Returns:
        ``starts`` with ``starts[p]:starts[p + 1]`` the samples of pack ``p``.
    """
    starts = [0]
    used = 0
    for index, length in enumerate(lengths.tolist()):
        if used + length > max_seq_len:
            starts.append(index)
            used = 0
        used += length
    if len(lengths):
        starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


class TokenizedDataset(Dataset):
    """A map-style dataset of tokenized items, read lazily from an Arrow table.

    Items are ``{"tokens", "labels"}`` (SFT; packs add ``input_pos`` and ``document_ids``) or
    ``{"chosen_tokens", "chosen_labels", "rejected_tokens", "rejected_labels"}`` (preference).

    Attributes:
        num_skipped: Malformed rows skipped (``skip_malformed=True``); the recipe logs it.
        num_truncated: Samples (or preference pairs) cut to ``max_seq_len``.
        num_dropped: Preference pairs dropped because truncation left no completion token.
        packed: Whether items are packs (with ``input_pos`` and ``document_ids``).
        kind: ``sft`` or ``preference``.
        cache_folder: The tokenized table's cache folder (None when it is in memory).
    """

    def __init__(
        self,
        table: Any,
        *,
        kind: str,
        source_names: list[str],
        skip_malformed: bool,
        packed: bool = False,
        max_seq_len: int | None = None,
        pad_id: int = 0,
        describe: str = "",
    ) -> None:
        """Open a tokenized table.

        Args:
            table: The ``MappedTable`` of ``cache.tokenized_table``.
            kind: ``sft`` or ``preference``.
            source_names: The sources' names, by the table's ``source`` index (for errors).
            skip_malformed: Skip malformed rows instead of raising on the first.
            packed: Pack samples into ``max_seq_len`` sequences.
            max_seq_len: Pack length (and, for messages, the cut used when tokenizing).
            pad_id: Token id of a pack's padded tail.
            describe: What a preference error calls the dataset (its ``source`` argument).

        Raises:
            DataError: For the first malformed row (file, line, 0-based row, column) unless
                skipping; when no row is usable; when no preference pair keeps a completion.
        """
        self.kind = kind
        self.packed = packed
        # The folder of the memory-mapped table (None for an in-memory one): a precomputed
        # teacher top-k is stored under it (tunelab.distill.TeacherTopKCache).
        files = getattr(table, "cache_files", None)
        self.cache_folder = Path(files[0]["filename"]).parent if files else None
        self._max_seq_len = max_seq_len
        self._pad_id = pad_id
        malformed = _flags(table, "problem")
        if malformed.any() and not skip_malformed:
            raise DataError(malformed_message(table, int(np.argmax(malformed)), source_names))
        self.num_skipped = int(malformed.sum())
        usable = ~malformed
        if not usable.any():
            raise DataError(
                f"{', '.join(source_names)}: no usable rows ({self.num_skipped} malformed rows "
                "skipped)"
            )
        self.num_truncated = int((usable & _flags(table, "truncated")).sum())
        kept = usable & _flags(table, "completion")
        self.num_dropped = int(usable.sum() - kept.sum())
        if not kept.any():
            raise DataError(
                f"{describe}: max_seq_len={max_seq_len} leaves no completion token in any pair; "
                "raise max_seq_len"
            )
        # Row numbers of the samples used; None when that is every row (no copy at all).
        self._rows = None if kept.all() else np.flatnonzero(kept)
        self._table = table.select_columns(list(SAMPLE_COLUMNS[kind]))
        self._starts = None
        if packed:
            lengths = _list_lengths(table.data.column("tokens"))
            self._starts = pack_starts(
                lengths if self._rows is None else lengths[self._rows], max_seq_len
            )

    def __len__(self) -> int:
        """Number of items (packs when packed)."""
        if self._starts is not None:
            return len(self._starts) - 1
        return len(self._table) if self._rows is None else len(self._rows)

    def _sample(self, position: int) -> dict[str, list[int]]:
        row = position if self._rows is None else int(self._rows[position])
        return self._table[row]

    def num_longer_than(self, length: int) -> int:
        """Samples used (preference pairs: either side) with more than ``length`` tokens.

        Read from the table's list lengths, unpacked: a pack of short documents counts none.
        """
        longer = None
        for name in SAMPLE_COLUMNS[self.kind]:
            if not name.endswith("tokens"):
                continue
            lengths = _list_lengths(self._table.data.column(name))
            side = lengths > length
            longer = side if longer is None else longer | side
        if longer is None:
            return 0
        return int(longer.sum() if self._rows is None else longer[self._rows].sum())

    def first_token_lists(self, count: int) -> list[list[int]]:
        """The token ids of the first ``count`` samples (both sides of a pair), unpacked."""
        num_samples = len(self._table) if self._rows is None else len(self._rows)
        lists = []
        for position in range(min(count, num_samples)):
            sample = self._sample(position)
            lists += [list(v) for k, v in sample.items() if k.endswith("tokens")]
        return lists

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Return item ``index``, read from the table."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items")
        index %= len(self)
        if self._starts is None:
            return self._sample(index)
        start, end = int(self._starts[index]), int(self._starts[index + 1])
        samples = [self._sample(position) for position in range(start, end)]
        (pack,) = pack_samples(samples, self._max_seq_len, self._pad_id, IGNORE_INDEX)
        return pack


def build_tokenized(
    tokenizer: Tokenizer,
    *,
    builder: str,
    settings: dict[str, Any],
    rows_for: Callable[[str, list[str]], RowFunction],
    sources: list[Source],
    skip_malformed: bool,
    kind: str = "sft",
    packed: bool = False,
    max_seq_len: int | None = None,
    num_proc: int | None = None,
    cache_dir: str | None = None,
    describe: str = "",
    allow_unknown_tokens: bool = False,
    streaming: bool = False,
    shuffle_buffer_size: int | None = None,
) -> Any:
    """Tokenize ``sources`` once per machine (``cache.tokenized_table``) and open the table.

    With ``streaming`` nothing is tokenized ahead: the result is a ``StreamingDataset`` over
    the same row functions.

    Args:
        tokenizer: The tokenizer.
        builder: The builder's name (part of the cache key).
        settings: Every builder argument that changes the samples (part of the cache key).
        rows_for: A source's name and columns to its row function.
        sources: The resolved sources.
        skip_malformed: Skip malformed rows instead of raising.
        kind: ``sft`` or ``preference``.
        packed: Pack samples into ``max_seq_len`` sequences.
        max_seq_len: The samples' cut and pack length.
        num_proc: Tokenizing processes on local rank 0; with ``streaming``, worker processes
            per rank that read and tokenize ahead (default 1).
        cache_dir: Root of the tokenized cache.
        describe: What a preference error calls the dataset.
        allow_unknown_tokens: Skip ``check_tokens_fit`` (the first samples may be mostly
            unknown or padding tokens).
        streaming: Return a ``StreamingDataset`` (SFT only).
        shuffle_buffer_size: Rows per shuffle window of a stream (streaming only).

    Returns:
        The dataset (a ``TokenizedDataset``, or a ``StreamingDataset`` with ``streaming``).

    Raises:
        ConfigError: For ``shuffle_buffer_size`` without ``streaming``.
        DataError: For a malformed row, or a tokenizer that does not fit the data.
    """
    if streaming:
        return _stream(
            tokenizer, rows_for, sources, skip_malformed, kind, packed, max_seq_len,
            shuffle_buffer_size, allow_unknown_tokens, num_proc,
        )  # fmt: skip
    if shuffle_buffer_size is not None:
        raise ConfigError(
            f"dataset.shuffle_buffer_size={shuffle_buffer_size} applies to streaming only: "
            "set streaming: true or remove it"
        )
    table = tokenized_table(
        builder=builder,
        kind=kind,
        settings=settings,
        tokenizer=tokenizer,
        sources=sources,
        rows_for=rows_for,
        num_proc=num_proc,
        cache_dir=cache_dir,
    )
    dataset = TokenizedDataset(
        table,
        kind=kind,
        source_names=[source.name for source in sources],
        skip_malformed=skip_malformed,
        packed=packed,
        max_seq_len=max_seq_len,
        pad_id=tokenizer.pad_id,
        describe=describe,
    )
    if not allow_unknown_tokens:
        where = ", ".join(source.name for source in sources)
        check_tokens_fit(tokenizer, dataset.first_token_lists(UNKNOWN_CHECK_SAMPLES), where)
    return dataset


def _stream(
    tokenizer: Tokenizer,
    rows_for: Callable[[str, list[str]], RowFunction],
    sources: list[Source],
    skip_malformed: bool,
    kind: str,
    packed: bool,
    max_seq_len: int | None,
    shuffle_buffer_size: int | None,
    allow_unknown_tokens: bool,
    num_proc: int | None,
) -> Any:
    """The ``StreamingDataset`` of ``build_tokenized(streaming=True)``."""
    if kind != "sft":
        raise ConfigError(f"dataset.streaming: supports SFT datasets only, not {kind} data")
    dataset = StreamingDataset(
        tokenizer,
        rows_for=rows_for,
        sources=expand_folders(sources),
        skip_malformed=skip_malformed,
        packed=packed,
        max_seq_len=max_seq_len,
        shuffle_buffer_size=shuffle_buffer_size or DEFAULT_SHUFFLE_BUFFER,
        num_proc=1 if num_proc is None else num_proc,
    )
    if not allow_unknown_tokens:
        dataset.check_tokens_fit(tokenizer)
    return dataset
