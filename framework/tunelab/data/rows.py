"""Source rows to samples: column layouts, typed reads, and each builder's row function.

The second stage of the data path (``sources`` reads rows; here a row is rendered with its
template and tokenized; ``cache`` runs that over a whole source; ``tokenized`` opens the
result; ``packing`` and ``collate`` make batches). A row that cannot become a sample raises
``BadRow``; the tokenizing pass records it (file, row, line, column, problem) and the dataset
raises or skips it (``skip_malformed``). The row functions run in the tokenizing processes, so
they are plain dataclasses that pickle with what they need: the tokenizer, the template, the
columns, the cut.
"""

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tunelab.data.chat import tokenize_conversation
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError
from tunelab.data.templates import ROLES, Message, Template, tokenize_messages
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import ConfigError, DataError

# The label of a token that is not trained (PyTorch's cross-entropy ignore_index).
IGNORE_INDEX = -100

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


def conversation_style(value: Any, column: str, style: str) -> str:
    """Check that ``value`` is a non-empty list of messages; its style (``auto`` resolved).

    ``auto`` is ``sharegpt`` when the first message has ``from`` or ``value`` and no OpenAI
    key (``role``, ``content``), else ``openai``.

    Raises:
        BadRow: If the conversation is missing, not a list, or empty.
    """
    if value is None:
        raise BadRow(column, "missing value")
    if not isinstance(value, list):
        raise BadRow(column, f"expected a list of messages, got {type(value).__name__}")
    if not value:
        raise BadRow(column, "empty conversation")
    if style != "auto":
        return style
    first = value[0]
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
    style = conversation_style(value, column, style)
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


def to_sample(tokens: list[int], mask: list[bool], max_seq_len: int | None) -> tuple[dict, bool]:
    """Make ``{"tokens", "labels"}``, cut to ``max_seq_len``; also return whether it was cut."""
    truncated = max_seq_len is not None and len(tokens) > max_seq_len
    if truncated:
        tokens, mask = tokens[:max_seq_len], mask[:max_seq_len]
    labels = [IGNORE_INDEX if masked else token for token, masked in zip(tokens, mask)]
    return {"tokens": tokens, "labels": labels}, truncated


def tokenize_turns(
    tokenizer: Tokenizer,
    template: Template | ChatTemplate,
    pairs: list[tuple[str, str]],
    *,
    train_on_input: bool,
    template_kwargs: Mapping[str, Any] | None,
    column: str,
) -> list[tuple[list[int], list[bool]]]:
    """Tokenize ``(role, content)`` turns; a chat template may give one sample per turn.

    Raises:
        BadRow: If the chat template fails on this conversation (naming the template).
    """
    if not isinstance(template, ChatTemplate):
        messages = to_messages(pairs, train_on_input)
        return [tokenize_messages(tokenizer, messages, template)]
    messages = [{"role": role, "content": content} for role, content in pairs]
    try:
        return tokenize_conversation(
            tokenizer,
            messages,
            train_on_input=train_on_input,
            template_kwargs=template_kwargs,
            template=template,
        )
    except ChatTemplateError as error:
        raise BadRow(column, str(error)) from None


def _record(tokens: list[int], mask: list[bool], max_seq_len: int | None) -> dict[str, Any]:
    sample, cut = to_sample(tokens, mask, max_seq_len)
    return {**sample, "truncated": cut}


@dataclass
class Render:
    """How a builder turns ``(role, content)`` turns into samples."""

    tokenizer: Tokenizer
    template: Template | ChatTemplate
    template_kwargs: Mapping[str, Any] | None
    train_on_input: bool
    max_seq_len: int | None
    train_on_reasoning: bool = True

    @property
    def max_chars(self) -> int | None:
        """Characters of a text that can reach a sample (``text_bound``)."""
        return text_bound(self.tokenizer.longest_token_chars, self.max_seq_len)

    def conversation(
        self,
        messages: list[dict[str, Any]],
        column: str,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """The samples of a chat-template conversation (tool calls, reasoning, tools, ...).

        Raises:
            BadRow: If the chat template fails on it.
        """
        assert isinstance(self.template, ChatTemplate)
        try:
            turns = tokenize_conversation(
                self.tokenizer,
                messages,
                train_on_input=self.train_on_input,
                train_on_reasoning=self.train_on_reasoning,
                tools=tools,
                documents=documents,
                template_kwargs=self.template_kwargs,
                template=self.template,
            )
        except ChatTemplateError as error:
            raise BadRow(column, str(error)) from None
        return [_record(tokens, mask, self.max_seq_len) for tokens, mask in turns]

    def samples(self, pairs: list[tuple[str, str]], column: str) -> list[dict[str, Any]]:
        """The samples of a row's (input, output) turns, read from ``column``."""
        turns = tokenize_turns(
            self.tokenizer,
            self.template,
            pairs,
            train_on_input=self.train_on_input,
            template_kwargs=self.template_kwargs,
            column=column,
        )
        return [_record(tokens, mask, self.max_seq_len) for tokens, mask in turns]


@dataclass
class InstructRows:
    """Row function of ``instruct_dataset``: an alpaca row as a user and an assistant turn."""

    render: Render
    columns: dict[str, str]

    @property
    def max_chars(self) -> int | None:
        """Characters of a text that can reach a sample (``text_bound``)."""
        return self.render.max_chars

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Samples of one row; raises ``BadRow``."""
        instruction = read_text(row, self.columns["instruction"])
        given = read_text(row, self.columns["input"], optional=True)
        output = read_text(row, self.columns["output"])
        user = self.render.template.join_instruction(instruction, given)
        return self.render.samples([("user", user), ("assistant", output)], "(whole row)")


@dataclass
class TextRows:
    """Row function of ``text_dataset``: BOS + text + EOS, every token but the first trained."""

    tokenizer: Tokenizer
    column: str
    max_seq_len: int | None

    @property
    def max_chars(self) -> int | None:
        """Characters of a text that can reach a sample (``text_bound``)."""
        return text_bound(self.tokenizer.longest_token_chars, self.max_seq_len)

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Samples of one row; raises ``BadRow``."""
        text = read_text(row, self.column)
        tokens = self.tokenizer.encode(text, add_bos=True, add_eos=True)
        # The first token is never a target (nothing before it in its document predicts it);
        # masking it keeps packed documents from predicting each other through the shift.
        mask = [i == 0 for i in range(len(tokens))]
        return [_record(tokens, mask, self.max_seq_len)]
