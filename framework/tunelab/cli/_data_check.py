"""Broken rows of local JSON / JSON Lines data, found before any worker starts.

The workers find a malformed row too, but only after they start, import torch and load the
model (5 to 6 s on the tiny model, minutes on a real one). The rows of a local JSON or JSONL
file can be read with the ``json`` module alone, so ``tunelab run`` and ``tunelab validate``
read them first, the way the data pipeline does (``tunelab._json_lines``), and stop at the
first broken one with the line the workers would give. Files over ``MAX_CHECKED_BYTES`` are
left to the workers (reading them twice would cost more than the start-up it saves), and so is
every dataset with ``skip_malformed: true`` (its broken rows are skipped, not an error).

A prompt dataset (GRPO's) has one column that matters before rendering, so its rows are also
held to the checks that need no tokenizer: the column exists in the file, and each row's prompt
is there and not empty (``file:line: row N (0-based), column 'prompt': empty text ...``, the
message the workers give). What needs the template (roles, tool calls) is left to them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tunelab._json_lines import json_rows
from tunelab.errors import DataError

MAX_CHECKED_BYTES = 64 * 2**20
"""Local JSON files up to this size are read before launch; larger ones only by the workers."""

_JSON_SUFFIXES = (".json", ".jsonl")
# The prompt dataset, as configs name it (the package's export and the defining module).
_PROMPT_DATASETS = ("tunelab.data.prompt_dataset", "tunelab.data.prompts.prompt_dataset")
_SKIP_HINT = "(set skip_malformed: true to skip such rows)"


def _dataset_nodes(value: Any) -> Iterator[dict]:
    """Every mapping with a ``source`` key in a settings value (datasets, mixed ones included)."""
    if isinstance(value, (DictConfig, ListConfig)):
        try:
            value = OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException:
            return  # Validation reports it.
    if isinstance(value, dict):
        if isinstance(value.get("source"), str):
            yield value
        for item in value.values():
            yield from _dataset_nodes(item)
    elif isinstance(value, list):
        for item in value:
            yield from _dataset_nodes(item)


def _json_files(node: dict) -> list[Path]:
    source, data_files = node["source"], node.get("data_files")
    if source == "json":
        if isinstance(data_files, dict):
            data_files = data_files.get(node.get("split", "train"))
        files = [data_files] if isinstance(data_files, str) else data_files or []
    else:
        files = [source]
    found = [Path(file).expanduser() for file in files if isinstance(file, str)]
    return [file for file in found if file.suffix.lower() in _JSON_SUFFIXES and file.is_file()]


def check_json_rows(args: object) -> None:
    """Read the local JSON / JSONL files of a run's datasets and refuse the first broken row.

    Args:
        args: The recipe's validated settings; every field holding dataset nodes is read.

    Raises:
        DataError: ``<file>:<line>: <what is wrong> (set skip_malformed: true to skip such
            rows)`` for the first line that is not a JSON row (not UTF-8, not JSON); for a
            prompt dataset, the first row without a usable prompt, as the workers name it.
    """
    for value in vars(args).values():
        for node in _dataset_nodes(value):
            if node.get("skip_malformed") is True:
                continue
            field = node.get("field")
            prompt = _prompt_column(node)
            for file in _json_files(node):
                if file.stat().st_size > MAX_CHECKED_BYTES:
                    continue
                rows = json_rows(file, field if isinstance(field, str) else None)
                _check_rows(file, rows, *prompt)


def _prompt_column(node: dict) -> tuple[str | None, bool]:
    """A prompt dataset's ``(prompt column, whether lists are prompts)``; ``(None, False)`` else."""
    if node.get("_component_") not in _PROMPT_DATASETS:
        return None, False
    column = node.get("prompt_column", "prompt")
    # template: null encodes a string; a list is then "expected a string", said by the workers.
    return (column if isinstance(column, str) else None), node.get("template", "auto") is not None


def _row_problem(row: Any, column: str, lists: bool) -> tuple[str, str] | None:
    """``(column, problem)`` of a prompt row the workers would refuse before rendering it."""
    if not isinstance(row, dict):
        return "(whole row)", f"expected an object, got {type(row).__name__}"
    value = row.get(column)
    if value is None:
        return column, "missing value"
    if isinstance(value, str) and not value.strip():
        return column, "empty text"
    if lists and isinstance(value, list) and not value:
        return column, "empty conversation"
    return None


def _check_rows(
    file: Path,
    rows: Iterator[tuple[str | None, int | None, Any]],
    column: str | None,
    lists: bool = False,
) -> None:
    """Refuse the first broken line; with a prompt ``column``, also a missing or empty prompt.

    The prompt checks are ``prompt_dataset``'s first ones, in its words: a file without the
    column in any row (``no column``), a row that is not an object, a row without a value
    (``missing value``), a blank string (``empty text``), an empty list of messages (``empty
    conversation``). As the workers do, the first malformed row is named after the columns of
    the whole file are known.

    Raises:
        DataError: For the first problem, named as the workers name it.
    """
    first: str | None = None
    seen: dict[str, None] = {}
    for index, (text, line, row) in enumerate(rows):
        if text is None and column is None:
            raise DataError(f"{file}:{line}: {row} {_SKIP_HINT}")
        if column is None:
            continue
        found = ("(whole row)", row) if text is None else _row_problem(row, column, lists)
        if isinstance(row, dict) and text is not None:
            seen.update(dict.fromkeys(row))
        if found is not None and first is None:
            where = f"{file}:{line}" if line is not None else str(file)
            first = f"{where}: row {index} (0-based), column {found[0]!r}: {found[1]} {_SKIP_HINT}"
    if seen and column not in seen:  # a configuration mistake, never skipped
        raise DataError(
            f"{file}: no column {column!r} (columns: {', '.join(seen)}); name it with prompt_column"
        )
    if first is not None:
        raise DataError(first)
