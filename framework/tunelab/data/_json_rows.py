"""JSON and JSON Lines files read with the ``json`` module into an Arrow file of one schema.

Each row is stored as its own JSON text in a string column (``_json``), with its 1-based line
(``_line``; None inside one JSON document) and, for a line that is not a row, why
(``_problem``: not UTF-8, not JSON). Whatever the rows hold, the schema is the same, so no
value is coerced (``datasets`` would turn the string ``"42"`` into the integer ``42`` in a
column that mixes types) and the tokenizing pass decodes each row exactly as written.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunelab.errors import DataError

# Columns of the table a JSON file is read into.
JSON_TEXT, JSON_LINE, JSON_PROBLEM = "_json", "_line", "_problem"
# Rows per Arrow record batch while reading: bounds the reader's memory, not the file's.
_BATCH_ROWS = 8192


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


def _json_rows(file: Path, field: str | None) -> Iterator[tuple[str | None, int | None, Any]]:
    """Yield ``(json_text, line, problem_or_row)`` for every row of a JSON or JSONL file."""
    document = _json_document(file, field)
    if document is not None:
        for row in document:
            yield json.dumps(row, ensure_ascii=False), None, row
        return
    with file.open("rb") as stream:
        # Lines end at b"\n" only: a JSON string may hold U+2028 or a form feed unescaped,
        # which str.splitlines would take for line ends.
        for number, raw in enumerate(stream, start=1):
            text, problem = _decode_line(raw, number)
            if problem is not None:
                yield None, number, problem
                continue
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as error:
                yield None, number, f"not valid JSON ({json_fault(text, error)})"
                continue
            yield text, number, row


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
            for text, line, row in _json_rows(file, field):
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
