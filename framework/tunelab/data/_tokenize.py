"""The tokenizing pass: source rows to Arrow rows of samples, one per sample or malformed row.

``Dataset.map`` calls ``TokenizeRows`` on batches of a source's rows (in ``num_proc`` worker
processes when the source is large). A row becomes zero or more samples (a chat template may
give one sample per assistant turn); a malformed row becomes one row whose ``problem`` says
what is wrong with it, so that raising or skipping (``skip_malformed``) is decided when the
cached table is opened, and the cache serves both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from tunelab.data._json_rows import JSON_LINE, JSON_PROBLEM, JSON_TEXT
from tunelab.data._rows import BadRow, cut_long_text

# The token columns of each kind of sample.
SAMPLE_COLUMNS = {
    "sft": ("tokens", "labels"),
    "preference": ("chosen_tokens", "chosen_labels", "rejected_tokens", "rejected_labels"),
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
    columns = {name: Sequence(Value("int32")) for name in SAMPLE_COLUMNS[kind]}
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
        json_rows: Whether the batch holds JSON text (``_json_rows``) to decode.
        max_chars: Strings of a row are cut to this many characters before the row function
            sees them (``_rows.text_bound``: past it no character reaches a sample); None
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
