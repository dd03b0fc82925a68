"""Supervised fine-tuning datasets: instruct rows, chat conversations, plain text.

Builders load every row and tokenize it at construction: fine-tuning sets are small, and a
malformed row then stops the run before training starts, naming the file, the row and the
column. Items are ``{"tokens": [...], "labels": [...]}`` with ``labels`` aligned to
``tokens`` (``labels[i]`` is ``tokens[i]``, or ``-100`` where masked); the recipe's loss shifts.
"""

from collections.abc import Mapping
from typing import Any

from torch.utils.data import Dataset

from tunelab.data import _rows
from tunelab.data.chat import tokenize_conversation
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError
from tunelab.data.packing import pack_samples
from tunelab.data.sources import load_sources
from tunelab.data.templates import Template, get_template, tokenize_messages
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import ConfigError

IGNORE_INDEX = -100


class TokenizedDataset(Dataset):
    """A map-style dataset of pre-tokenized items.

    Attributes:
        num_skipped: Malformed rows skipped (``skip_malformed=True``); the recipe logs it.
        num_truncated: Samples (or preference pairs) cut to ``max_seq_len``.
        num_dropped: Preference pairs dropped because truncation left no completion token.
        packed: Whether items are packs (with ``input_pos`` and ``document_ids``).
    """

    def __init__(
        self,
        items: list[dict[str, Any]],
        *,
        num_skipped: int = 0,
        num_truncated: int = 0,
        num_dropped: int = 0,
        packed: bool = False,
    ) -> None:
        """Hold ``items``; the counts describe how they were made."""
        self._items = items
        self.num_skipped = num_skipped
        self.num_truncated = num_truncated
        self.num_dropped = num_dropped
        self.packed = packed

    def __len__(self) -> int:
        """Number of items (packs when packed)."""
        return len(self._items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Return item ``index``."""
        return self._items[index]


def to_sample(tokens: list[int], mask: list[bool], max_seq_len: int | None) -> tuple[dict, bool]:
    """Make ``{"tokens", "labels"}``, cut to ``max_seq_len``; also return whether it was cut."""
    truncated = max_seq_len is not None and len(tokens) > max_seq_len
    if truncated:
        tokens, mask = tokens[:max_seq_len], mask[:max_seq_len]
    labels = [IGNORE_INDEX if masked else token for token, masked in zip(tokens, mask)]
    return {"tokens": tokens, "labels": labels}, truncated


def resolve_template(
    tokenizer: Tokenizer, template: str, template_kwargs: Mapping[str, Any] | None
) -> Template | ChatTemplate:
    """The template a builder renders with; ``template_kwargs`` only make sense for ``auto``.

    Raises:
        ConfigError: For an unknown name, ``auto`` without a chat template, or
            ``template_kwargs`` with a named format (which would silently ignore them).
        DataError: If the chat template does not compile.
    """
    chosen = get_template(template, tokenizer)
    if template_kwargs and not isinstance(chosen, ChatTemplate):
        raise ConfigError(
            f"template_kwargs are variables of the tokenizer's chat template (template: auto); "
            f"the named format {template!r} has none"
        )
    if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
        raise ConfigError(
            f"template_kwargs must be a mapping, got {type(template_kwargs).__name__}"
        )
    return chosen


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


def _finish(
    tokenizer: Tokenizer,
    samples_and_cuts: list[tuple[dict, bool]],
    num_skipped: int,
    max_seq_len: int | None,
    packed: bool,
) -> TokenizedDataset:
    samples = [sample for sample, _ in samples_and_cuts]
    num_truncated = sum(cut for _, cut in samples_and_cuts)
    if packed:
        samples = pack_samples(samples, max_seq_len, tokenizer.pad_id, IGNORE_INDEX)
    return TokenizedDataset(
        samples, num_skipped=num_skipped, num_truncated=num_truncated, packed=packed
    )


def _check_lengths(tokenizer: Tokenizer, max_seq_len: int | None, packed: bool) -> int | None:
    max_seq_len = max_seq_len if max_seq_len is not None else tokenizer.max_seq_len
    if max_seq_len is not None and max_seq_len < 1:
        raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
    if packed and max_seq_len is None:
        raise ConfigError("packed: true needs max_seq_len (the length of each pack)")
    return max_seq_len


def instruct_dataset(
    tokenizer: Tokenizer,
    *,
    source: str,
    data_files: Any = None,
    split: str = "train",
    column_map: dict[str, str] | None = None,
    template: str = "instruct",
    template_kwargs: dict[str, Any] | None = None,
    train_on_input: bool = False,
    max_seq_len: int | None = None,
    packed: bool = False,
    skip_malformed: bool = False,
    **load_dataset_kwargs: Any,
) -> TokenizedDataset:
    """Instruction rows (alpaca ``instruction`` / ``input`` / ``output``) as SFT samples.

    Each row becomes a user message (the instruction, plus the input when non-empty) and an
    assistant message (the output), rendered with ``template``. For an instruct model use
    ``template: auto``, its own chat template.

    Args:
        tokenizer: The tokenizer (passed by the recipe).
        source: ``json`` / ``parquet`` / ``text`` / ``csv`` with ``data_files``, a local file
            path (its suffix decides), a local folder, or a hub dataset id.
        data_files: File path(s) for a loader ``source``.
        split: Split to read.
        column_map: Our column name to the file's, e.g. ``{"output": "response"}``; keys among
            ``instruction``, ``input``, ``output``. ``input`` may be absent from the file.
        template: ``auto`` (the tokenizer's chat template), or for a base model ``instruct``,
            ``alpaca``, ``chatml`` or ``llama3``.
        template_kwargs: Extra variables for the chat template (``auto`` only), e.g.
            ``{"date_string": "26 Jul 2024"}``.
        train_on_input: Also train on the prompt tokens (with ``auto``: every token but the
            first).
        max_seq_len: Cut samples to this many tokens (default: the tokenizer's).
        packed: Pack samples into ``max_seq_len`` sequences.
        skip_malformed: Skip malformed rows (counted in ``num_skipped``) instead of raising.
        **load_dataset_kwargs: Passed to ``datasets.load_dataset``.

    Returns:
        The dataset.

    Raises:
        ConfigError: For an unknown template or column_map key, packing without a length, or
            ``auto`` with a tokenizer that has no chat template.
        DataError: For a missing file or column, or a malformed row (file, 0-based row, column),
            including a row the chat template refuses.
    """
    max_seq_len = _check_lengths(tokenizer, max_seq_len, packed)
    chosen = resolve_template(tokenizer, template, template_kwargs)
    columns = _rows.resolve_columns(
        {"instruction": "instruction", "input": "input", "output": "output"},
        column_map,
        "instruct_dataset",
    )
    sources = load_sources(source, data_files, split, **load_dataset_kwargs)
    _rows.require_columns(sources, [columns["instruction"], columns["output"]])

    def make(row: dict[str, Any]) -> list[tuple[dict, bool]]:
        instruction = _rows.read_text(row, columns["instruction"])
        given = _rows.read_text(row, columns["input"], optional=True)
        output = _rows.read_text(row, columns["output"])
        pairs = [("user", chosen.join_instruction(instruction, given)), ("assistant", output)]
        turns = tokenize_turns(
            tokenizer,
            chosen,
            pairs,
            train_on_input=train_on_input,
            template_kwargs=template_kwargs,
            column="(whole row)",
        )
        return [to_sample(tokens, mask, max_seq_len) for tokens, mask in turns]

    rows, num_skipped = _rows.build_samples(sources, make, skip_malformed)
    samples = [sample for row_samples in rows for sample in row_samples]
    return _finish(tokenizer, samples, num_skipped, max_seq_len, packed)


def chat_dataset(
    tokenizer: Tokenizer,
    *,
    source: str,
    data_files: Any = None,
    split: str = "train",
    conversation_column: str = "messages",
    conversation_style: str = "openai",
    template: str = "auto",
    template_kwargs: dict[str, Any] | None = None,
    train_on_input: bool = False,
    max_seq_len: int | None = None,
    packed: bool = False,
    skip_malformed: bool = False,
    **load_dataset_kwargs: Any,
) -> TokenizedDataset:
    """Conversations as SFT samples; by default only assistant turns are trained.

    With ``template: auto`` (the default) each conversation is rendered with the tokenizer's
    own chat template, and assistant turns are trained as that template renders them; a
    template that re-renders earlier turns once later ones exist gives one sample per
    assistant turn (see ``tunelab.data.chat``).

    Args:
        tokenizer: The tokenizer (passed by the recipe).
        source: As for ``instruct_dataset``.
        data_files: File path(s) for a loader ``source``.
        split: Split to read.
        conversation_column: The column holding each conversation (a list of messages).
        conversation_style: ``openai`` (``{"role", "content"}``; system/user/assistant) or
            ``sharegpt`` (``{"from", "value"}``; system/human/gpt).
        template: ``auto`` (the tokenizer's chat template), or for a base model ``chatml``,
            ``llama3``, ``instruct`` or ``alpaca``.
        template_kwargs: Extra variables for the chat template (``auto`` only), e.g.
            ``{"enable_thinking": False}``.
        train_on_input: Also train on system and user turns (with ``auto``: on every token but
            the first).
        max_seq_len: Cut samples to this many tokens (default: the tokenizer's).
        packed: Pack samples into ``max_seq_len`` sequences.
        skip_malformed: Skip malformed rows (counted in ``num_skipped``) instead of raising.
        **load_dataset_kwargs: Passed to ``datasets.load_dataset``.

    Returns:
        The dataset.

    Raises:
        ConfigError: For an unknown template or style, packing without a length, or ``auto``
            with a tokenizer that has no chat template.
        DataError: For a missing file or column, or a malformed row (file, 0-based row, column),
            including a conversation the chat template refuses.
    """
    if conversation_style not in ("openai", "sharegpt"):
        raise ConfigError(
            f"conversation_style must be 'openai' or 'sharegpt', got {conversation_style!r}"
        )
    max_seq_len = _check_lengths(tokenizer, max_seq_len, packed)
    chosen = resolve_template(tokenizer, template, template_kwargs)
    sources = load_sources(source, data_files, split, **load_dataset_kwargs)
    _rows.require_columns(sources, [conversation_column])

    def make(row: dict[str, Any]) -> list[tuple[dict, bool]]:
        pairs = _rows.read_messages(
            row.get(conversation_column), conversation_column, conversation_style
        )
        _rows.check_answer(pairs, conversation_column)
        turns = tokenize_turns(
            tokenizer,
            chosen,
            pairs,
            train_on_input=train_on_input,
            template_kwargs=template_kwargs,
            column=conversation_column,
        )
        return [to_sample(tokens, mask, max_seq_len) for tokens, mask in turns]

    rows, num_skipped = _rows.build_samples(sources, make, skip_malformed)
    samples = [sample for row_samples in rows for sample in row_samples]
    return _finish(tokenizer, samples, num_skipped, max_seq_len, packed)


def text_dataset(
    tokenizer: Tokenizer,
    *,
    source: str,
    data_files: Any = None,
    split: str = "train",
    column: str = "text",
    max_seq_len: int | None = None,
    packed: bool = False,
    skip_malformed: bool = False,
    **load_dataset_kwargs: Any,
) -> TokenizedDataset:
    """Plain text (continued pre-training): every token trained, each row BOS + text + EOS.

    Args:
        tokenizer: The tokenizer (passed by the recipe).
        source: As for ``instruct_dataset``; ``text`` files give one row per line.
        data_files: File path(s) for a loader ``source``.
        split: Split to read.
        column: The text column.
        max_seq_len: Cut samples to this many tokens (default: the tokenizer's).
        packed: Pack samples into ``max_seq_len`` sequences.
        skip_malformed: Skip malformed (e.g. empty) rows instead of raising.
        **load_dataset_kwargs: Passed to ``datasets.load_dataset``.

    Returns:
        The dataset.

    Raises:
        ConfigError: If packing without a length.
        DataError: For a missing file or column, or a malformed row.
    """
    max_seq_len = _check_lengths(tokenizer, max_seq_len, packed)
    sources = load_sources(source, data_files, split, **load_dataset_kwargs)
    _rows.require_columns(sources, [column])

    def make(row: dict[str, Any]) -> tuple[dict, bool]:
        tokens = tokenizer.encode(_rows.read_text(row, column), add_bos=True, add_eos=True)
        # The first token is never a target (nothing before it in its document predicts it);
        # masking it keeps packed documents from predicting each other through the shift.
        mask = [i == 0 for i in range(len(tokens))]
        return to_sample(tokens, mask, max_seq_len)

    samples, num_skipped = _rows.build_samples(sources, make, skip_malformed)
    return _finish(tokenizer, samples, num_skipped, max_seq_len, packed)
