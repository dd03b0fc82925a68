"""Broken rows of local JSON / JSON Lines data, found before any worker starts.

The workers find a malformed row too, but only after they start, import torch and load the
model (5 to 6 s on the tiny model, minutes on a real one). The rows of a local JSON or JSONL
file can be read with the ``json`` module alone, so ``tunelab run`` and ``tunelab validate``
read them first, the way the data pipeline does (``tunelab._json_lines``), and stop at the
first broken one with the line the workers would give. Files over ``MAX_CHECKED_BYTES`` are
left to the workers (reading them twice would cost more than the start-up it saves), and so is
every dataset with ``skip_malformed: true`` (its broken rows are skipped, not an error).
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
            rows)`` for the first line that is not a JSON row (not UTF-8, not JSON).
    """
    for value in vars(args).values():
        for node in _dataset_nodes(value):
            if node.get("skip_malformed") is True:
                continue
            field = node.get("field")
            for file in _json_files(node):
                if file.stat().st_size > MAX_CHECKED_BYTES:
                    continue
                for text, line, problem in json_rows(
                    file, field if isinstance(field, str) else None
                ):
                    if text is None:
                        raise DataError(
                            f"{file}:{line}: {problem} (set skip_malformed: true to skip such rows)"
                        )
