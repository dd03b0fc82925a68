"""Row validation shared by the dataset builders: column layouts and typed reads.

A row that cannot become a sample raises ``BadRow``; the tokenizing pass records it (file, row,
line, column, problem) and the dataset raises or skips it (``skip_malformed``).
"""

import difflib
from collections.abc import Iterable
from typing import Any

from tunelab.data.templates import ROLES, Message
from tunelab.errors import ConfigError, DataError

# The first max_seq_len tokens of a text lie within its first max_seq_len * L characters when
# no token is longer than L characters; this many tokens' worth more absorbs a word cut short.
_SPARE_TOKENS = 256
_MIN_TOKEN_CHARS = 16


def text_bound(longest_token_chars: int, max_seq_len: int | None) -> int | None:
    """How many characters of a text can matter to a sample cut to ``max_seq_len`` tokens.

    A sample keeps its first ``max_seq_len`` tokens, and no token spans more than
    ``longest_token_chars`` characters, so text past ``(max_seq_len + spare) * longest``
    characters never reaches a sample: it is cut before the (costly) render and tokenization,
    and a 500 MB row costs what a row of that bound costs.

    Args:
        longest_token_chars: The tokenizer's longest token, in characters.
        max_seq_len: The sample length; None (no cut) bounds nothing.

    Returns:
        The bound in characters, or None.
    """
    if max_seq_len is None:
        return None
    return (max_seq_len + _SPARE_TOKENS) * max(longest_token_chars, _MIN_TOKEN_CHARS)


def cut_long_text(value: Any, max_chars: int | None) -> Any:
    """``value`` with every string in it (in nested lists and dicts) cut to ``max_chars``."""
    if max_chars is None:
        return value
    if isinstance(value, str):
        return value[:max_chars] if len(value) > max_chars else value
    if isinstance(value, dict):
        return {key: cut_long_text(item, max_chars) for key, item in value.items()}
    if isinstance(value, list):
        return [cut_long_text(item, max_chars) for item in value]
    return value


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


def require_columns(name: str, present: list[str], columns: Iterable[str]) -> None:
    """Check a source has every column (a config mistake, never skipped).

    Args:
        name: The source's name, for the message.
        present: The columns it has.
        columns: The columns it needs.

    Raises:
        DataError: Naming the file, the missing column and the columns it has.
    """
    for column in columns:
        if column not in present:
            raise DataError(
                f"{name}: no column {column!r} (columns: {', '.join(present) or 'none'}); "
                "map it with column_map"
            )


# Conversation layouts found by their column: OpenAI ``messages`` and ShareGPT ``conversations``.
CONVERSATION_COLUMNS = ("messages", "conversations")
STYLES = ("auto", "openai", "sharegpt")


def conversation_column_of(name: str, present: list[str], column: str | None) -> str:
    """The column holding conversations: ``column``, else ``messages`` or ``conversations``.

    Raises:
        DataError: If the source has no such column.
    """
    if column is not None:
        require_columns(name, present, [column])
        return column
    for candidate in CONVERSATION_COLUMNS:
        if candidate in present:
            return candidate
    raise DataError(
        f"{name}: no conversation column: expected 'messages' (OpenAI) or 'conversations' "
        f"(ShareGPT) (columns: {', '.join(present) or 'none'}); name it with "
        "conversation_column"
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


def _style_of(first: Any) -> str:
    """``sharegpt`` when the first message has ``from`` or ``value`` and no OpenAI key."""
    if isinstance(first, dict) and not {"role", "content"} & set(first):
        if {"from", "value"} & set(first):
            return "sharegpt"
    return "openai"


def read_messages(value: Any, column: str, style: str = "openai") -> list[tuple[str, str]]:
    """Read a conversation: a non-empty list of ``{"role", "content"}`` dicts.

    Args:
        value: The cell.
        column: Its column name, for errors.
        style: ``"openai"`` (role/content), ``"sharegpt"`` (from/value, human/gpt), or
            ``"auto"``: ShareGPT when the first message has ``from`` / ``value`` keys and no
            ``role`` / ``content``, OpenAI otherwise.

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
    if style == "auto":
        style = _style_of(value[0])
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
