"""Row validation shared by the dataset builders: typed reads and the malformed-row policy."""

import difflib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from tunelab.data.sources import InvalidRow, RowSource, iter_rows
from tunelab.data.templates import ROLES, Message
from tunelab.errors import ConfigError, DataError

T = TypeVar("T")

# ShareGPT speaker names to roles.
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}


class BadRow(Exception):
    """A row that cannot become a sample; the builder adds the file and row index."""

    def __init__(self, column: str, problem: str) -> None:
        super().__init__(problem)
        self.column = column
        self.problem = problem


def resolve_columns(
    defaults: dict[str, str], column_map: dict[str, str] | None, builder: str
) -> dict[str, str]:
    """Return our column name -> the file's column name.

    Raises:
        ConfigError: If ``column_map`` has a key the builder does not know.
    """
    columns = dict(defaults)
    for key, value in (column_map or {}).items():
        if key not in defaults:
            close = difflib.get_close_matches(key, defaults, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{builder}: column_map key {key!r} is not one of {', '.join(defaults)}{hint}"
            )
        columns[key] = value
    return columns


def require_columns(sources: list[RowSource], columns: Iterable[str]) -> None:
    """Check every source has every column (a config mistake, never skipped).

    Raises:
        DataError: Naming the file, the missing column and the columns it has.
    """
    for source in sources:
        for column in columns:
            if column not in source.columns:
                raise DataError(
                    f"{source.name}: no column {column!r} (columns: "
                    f"{', '.join(source.columns) or 'none'}); map it with column_map"
                )


def read_text(row: dict[str, Any], column: str, *, optional: bool = False) -> str:
    """Read a non-empty string column (``optional`` columns may be missing or empty).

    Raises:
        BadRow: If the value is missing, not a string, or empty.
    """
    value = row.get(column)
    if value is None:
        if optional:
            return ""
        raise BadRow(column, "missing value")
    if not isinstance(value, str):
        raise BadRow(column, f"expected a string, got {type(value).__name__}")
    if not optional and not value.strip():
        raise BadRow(column, "empty text")
    return value


def read_messages(value: Any, column: str, style: str = "openai") -> list[tuple[str, str]]:
    """Read a conversation: a non-empty list of ``{"role", "content"}`` dicts.

    Args:
        value: The cell.
        column: Its column name, for errors.
        style: ``"openai"`` (role/content) or ``"sharegpt"`` (from/value, human/gpt).

    Returns:
        ``(role, content)`` pairs with roles among ``system``, ``user``, ``assistant``.

    Raises:
        BadRow: If the conversation is missing, empty, or a message is malformed.
    """
    if value is None:
        raise BadRow(column, "missing value")
    if not isinstance(value, list):
        raise BadRow(column, f"expected a list of messages, got {type(value).__name__}")
    if not value:
        raise BadRow(column, "empty conversation")
    role_key, content_key = ("from", "value") if style == "sharegpt" else ("role", "content")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadRow(column, f"message {i}: expected a dict, got {type(message).__name__}")
        role, content = message.get(role_key), message.get(content_key)
        if role is None or content is None:
            missing = role_key if role is None else content_key
            raise BadRow(column, f"message {i}: missing {missing!r}")
        role = _SHAREGPT_ROLES.get(role) if style == "sharegpt" else role
        if role not in ROLES:
            known = ", ".join(_SHAREGPT_ROLES if style == "sharegpt" else ROLES)
            raise BadRow(column, f"message {i}: unknown role {message[role_key]!r} ({known})")
        if not isinstance(content, str):
            raise BadRow(column, f"message {i}: content is {type(content).__name__}, not a string")
        messages.append((role, content))
    return messages


def to_messages(pairs: list[tuple[str, str]], train_on_input: bool) -> list[Message]:
    """Make ``Message``s, masking all but assistant turns unless ``train_on_input``."""
    return [
        Message(role, content, masked=role != "assistant" and not train_on_input)
        for role, content in pairs
    ]


def check_answer(pairs: list[tuple[str, str]], column: str) -> None:
    """Require at least one assistant turn and no empty one.

    Raises:
        BadRow: If there is no assistant turn or one is empty.
    """
    replies = [content for role, content in pairs if role == "assistant"]
    if not replies:
        raise BadRow(column, "no assistant message")
    if any(not reply.strip() for reply in replies):
        raise BadRow(column, "empty assistant message")


def build_samples(
    sources: list[RowSource], make_sample: Callable[[dict[str, Any]], T], skip_malformed: bool
) -> tuple[list[T], int]:
    """Turn every row into a sample, raising on the first malformed row or skipping it.

    Args:
        sources: The loaded files.
        make_sample: Row to sample; raises ``BadRow`` for a malformed row.
        skip_malformed: Skip malformed rows instead of raising.

    Returns:
        ``(samples, num_skipped)``.

    Raises:
        DataError: Naming file, 0-based row index and column of the first malformed row (when
            not skipping), or when no row is usable.
    """
    samples: list[T] = []
    num_skipped = 0
    for source, index, row in iter_rows(sources):
        try:
            if isinstance(row, InvalidRow):
                raise BadRow("(whole row)", row.problem)
            if not isinstance(row, dict):
                raise BadRow("(whole row)", f"expected an object, got {type(row).__name__}")
            samples.append(make_sample(row))
        except BadRow as bad:
            if not skip_malformed:
                raise DataError(
                    f"{source.name}: row {index} (0-based), column {bad.column!r}: {bad.problem} "
                    "(set skip_malformed: true to skip such rows)"
                ) from None
            num_skipped += 1
    if not samples:
        names = ", ".join(source.name for source in sources)
        raise DataError(f"{names}: no usable rows ({num_skipped} malformed rows skipped)")
    return samples, num_skipped
