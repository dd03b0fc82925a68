"""JSON and JSON Lines files read with the ``json`` module into an Arrow file of one schema.

Each row is stored as its own JSON text in a string column (``_json``), with its 1-based line
(``_line``; None inside one JSON document) and, for a line that is not a row, why
(``_problem``: not UTF-8, not JSON). Whatever the rows hold, the schema is the same, so no
value is coerced (``datasets`` would turn the string ``"42"`` into the integer ``42`` in a
column that mixes types) and the tokenizing pass decodes each row exactly as written.
"""

from __future__ import annotations

from pathlib import Path

from tunelab._json_lines import json_rows
from tunelab.errors import DataError

# Columns of the table a JSON file is read into.
JSON_TEXT, JSON_LINE, JSON_PROBLEM = "_json", "_line", "_problem"
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
