"""Row functions of the SFT builders: one source row to its samples (``BadRow`` if malformed).

They run in the tokenizing processes (``tunelab.data._cache``), so they are plain dataclasses
that pickle with what they need: the tokenizer, the template, the columns, the cut.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tunelab.data import _rows
from tunelab.data.chat import tokenize_conversation
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError
from tunelab.data.templates import Template, tokenize_messages
from tunelab.data.tokenized import IGNORE_INDEX
from tunelab.data.tokenizer import Tokenizer


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
        messages = _rows.to_messages(pairs, train_on_input)
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
        raise _rows.BadRow(column, str(error)) from None


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

    @property
    def max_chars(self) -> int | None:
        """Characters of a text that can reach a sample (``_rows.text_bound``)."""
        return _rows.text_bound(self.tokenizer.longest_token_chars, self.max_seq_len)

    def samples(self, pairs: list[tuple[str, str]], column: str) -> list[dict[str, Any]]:
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
        """Characters of a text that can reach a sample (``_rows.text_bound``)."""
        return self.render.max_chars

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Samples of one row; raises ``BadRow``."""
        instruction = _rows.read_text(row, self.columns["instruction"])
        given = _rows.read_text(row, self.columns["input"], optional=True)
        output = _rows.read_text(row, self.columns["output"])
        user = self.render.template.join_instruction(instruction, given)
        return self.render.samples([("user", user), ("assistant", output)], "(whole row)")


@dataclass
class ChatRows:
    """Row function of ``chat_dataset``: one conversation."""

    render: Render
    column: str
    style: str

    @property
    def max_chars(self) -> int | None:
        """Characters of a text that can reach a sample (``_rows.text_bound``)."""
        return self.render.max_chars

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Samples of one row; raises ``BadRow``."""
        pairs = _rows.read_messages(row.get(self.column), self.column, self.style)
        _rows.check_answer(pairs, self.column)
        return self.render.samples(pairs, self.column)


@dataclass
class TextRows:
    """Row function of ``text_dataset``: BOS + text + EOS, every token but the first trained."""

    tokenizer: Tokenizer
    column: str
    max_seq_len: int | None

    @property
    def max_chars(self) -> int | None:
        """Characters of a text that can reach a sample (``_rows.text_bound``)."""
        return _rows.text_bound(self.tokenizer.longest_token_chars, self.max_seq_len)

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Samples of one row; raises ``BadRow``."""
        text = _rows.read_text(row, self.column)
        tokens = self.tokenizer.encode(text, add_bos=True, add_eos=True)
        # The first token is never a target (nothing before it in its document predicts it);
        # masking it keeps packed documents from predicting each other through the shift.
        mask = [i == 0 for i in range(len(tokens))]
        return [_record(tokens, mask, self.max_seq_len)]
