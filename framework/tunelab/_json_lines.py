"""The rows of a JSON or JSON Lines file as written, read with the ``json`` module alone.

Shared by the data pipeline (``tunelab.data.sources`` stores them in an Arrow file) and the
check before any worker starts (``tunelab.cli._data_check``), so a broken row is named the same
way by both; nothing here imports torch or ``datasets``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunelab.errors import DataError


def _decode_line(raw: bytes, number: int) -> tuple[str | None, str | None]:
    """``(text, None)`` for a UTF-8 line, ``(None, problem)`` otherwise."""
    try:
        # A UTF-8 byte order mark may start a file; json.loads refuses it.
        return raw.decode("utf-8-sig" if number == 1 else "utf-8"), None
    except UnicodeDecodeError as error:
        return None, f"not UTF-8 text (byte 0x{raw[error.start]:02x} at column {error.start + 1})"


def _json_document(file: Path, field: str | None) -> list[Any] | None:
    """The rows of a file holding one JSON document (an array, or an object), else None.

    A file is one document when it parses whole to an array or object, as JSON Lines with two
    or more rows never does. The whole file is parsed only when its first non-blank line is
    not a complete JSON value by itself (a document spread over lines, or a broken line).

    Raises:
        DataError: If ``field`` is given and the document has no such top-level key.
    """
    with file.open("rb") as stream:
        first = next((line for line in stream if line.strip()), None)
        if first is None:
            return None
        rest_blank = all(not line.strip() for line in stream)  # stops at the next row
    text, _ = _decode_line(first, 1)
    try:
        data = json.loads(text) if text is not None else None
        if not rest_blank:
            return None  # a complete first line and more rows: JSON Lines
    except json.JSONDecodeError:
        try:
            data = json.loads(file.read_text(encoding="utf-8-sig"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
    if data is None or isinstance(data, (str, int, float)):
        return None  # a scalar: one (malformed) JSON Lines row
    if rest_blank and isinstance(data, dict) and field is None and text is not None:
        return None  # one object on one line: JSON Lines of one row (errors name line 1)
    if field is not None:
        if not isinstance(data, dict) or field not in data:
            raise DataError(f"{file}: no top-level field {field!r}")
        data = data[field]
    return data if isinstance(data, list) else [data]


def json_rows(file: Path, field: str | None) -> Iterator[tuple[str | None, int | None, Any]]:
    """Yield ``(json_text, line, problem_or_row)`` for every row of a JSON or JSONL file.

    A file holding one JSON document (an array, or an object with ``field``) yields its
    items with line None; a JSON Lines file one entry per non-blank line: the row with its
    text, or, for a line that is not a row, ``(None, line, why)``.

    Args:
        file: The file.
        field: For a JSON document that is an object, the key holding the rows.

    Raises:
        DataError: If ``field`` is given and the document has no such top-level key.
    """
    document = _json_document(file, field)
    if document is not None:
        for row in document:
            yield json.dumps(row, ensure_ascii=False), None, row
        return
    with file.open("rb") as stream:
        # Lines end at b"\n" only: a JSON string may hold U+2028 or a form feed unescaped,
        # which str.splitlines would take for line ends.
        for number, raw in enumerate(stream, start=1):
            if is_row_line(raw, number):
                yield parse_line(raw, number)


def is_row_line(raw: bytes, number: int) -> bool:
    """Whether JSON Lines line ``number`` (1-based) is a row: not blank, without parsing it.

    A line that is not UTF-8 is a (malformed) row, as ``json_rows`` yields it.
    """
    if raw[:1] == b"{":  # the common case, decided without decoding
        return True
    text, problem = _decode_line(raw, number)
    return problem is not None or bool(text.strip())


def parse_line(raw: bytes, number: int) -> tuple[str | None, int, Any]:
    """``json_rows``' entry for line ``number`` of a JSON Lines file (a row line).

    Returns:
        ``(text, number, row)``, or ``(None, number, why)`` for a line that is not JSON.
    """
    text, problem = _decode_line(raw, number)
    if problem is not None:
        return None, number, problem
    try:
        return text, number, json.loads(text)
    except json.JSONDecodeError as error:
        return None, number, f"not valid JSON ({json_fault(text, error)})"


def json_document(file: Path, field: str | None) -> list[Any] | None:
    """The rows of a file holding one JSON document (an array, or an object), else None.

    Raises:
        DataError: If ``field`` is given and the document has no such top-level key.
    """
    return _json_document(file, field)


def json_fault(row: str, error: json.JSONDecodeError) -> str:
    """Where and what ``json.loads`` found wrong in one JSON Lines row.

    The row's own line end is not part of the row: a parser that reaches it has found the row
    unfinished (a missing closing brace, bracket or quote), which is said as such, with the
    column just past the row's last character.

    Args:
        row: The row's text, as read (with its line end).
        error: The error ``json.loads(row)`` raised.

    Returns:
        ``<what> at column N``, or ``<what> at the end of the row (column N): ...``.
    """
    content = row.rstrip("\r\n")
    what = error.msg.removesuffix(" at")  # "Invalid control character at" says where itself.
    if error.pos >= len(content.rstrip()):
        return (
            f"{what} at the end of the row (column {len(content) + 1}): "
            "a closing brace, bracket or quote is missing"
        )
    return f"{what} at column {error.pos + 1}"
