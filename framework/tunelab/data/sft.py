"""Supervised fine-tuning datasets: instruct rows, chat conversations, plain text.

Every row is validated and tokenized before training starts, so a malformed row stops the run
naming the file, the line, the row and the column. Tokenizing happens once per machine, into
the ``datasets`` cache (``tunelab.data.cache``), and items are read lazily from the cached
Arrow table (``TokenizedDataset``). Items are ``{"tokens": [...], "labels": [...]}`` with
``labels`` aligned to ``tokens`` (``labels[i]`` is ``tokens[i]``, or ``-100`` where masked);
the recipe's loss shifts.

Called without a tokenizer, a builder returns a ``DatasetSpec`` that ``mix_dataset`` builds
with its own (a config nests dataset nodes that way).
"""

from collections.abc import Mapping
from typing import Any

from tunelab.data.chat_template import ChatTemplate
from tunelab.data.conversations import ChatRows
from tunelab.data.mix import DatasetSpec
from tunelab.data.rows import (
    STYLES,
    InstructRows,
    Render,
    TextRows,
    conversation_column_of,
    require_columns,
    resolve_columns,
)
from tunelab.data.sources import resolve_sources
from tunelab.data.streaming import StreamingDataset
from tunelab.data.templates import Template, get_template
from tunelab.data.tokenized import TokenizedDataset, build_tokenized
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import ConfigError


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


def _check_lengths(tokenizer: Tokenizer, max_seq_len: int | None, packed: bool) -> int | None:
    max_seq_len = max_seq_len if max_seq_len is not None else tokenizer.max_seq_len
    if max_seq_len is not None and max_seq_len < 1:
        raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
    if packed and max_seq_len is None:
        raise ConfigError("packed: true needs max_seq_len (the length of each pack)")
    return max_seq_len


def instruct_dataset(
    tokenizer: Tokenizer | None = None,
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
    allow_unknown_tokens: bool = False,
    num_proc: int | None = None,
    cache_dir: str | None = None,
    streaming: bool = False,
    shuffle_buffer_size: int | None = None,
    **load_dataset_kwargs: Any,
) -> TokenizedDataset | StreamingDataset | DatasetSpec:
    """Instruction rows (alpaca ``instruction`` / ``input`` / ``output``) as SFT samples.

    Each row becomes a user message (the instruction, plus the input when non-empty) and an
    assistant message (the output), rendered with ``template``. For an instruct model use
    ``template: auto``, its own chat template.

    Args:
        tokenizer: The tokenizer (passed by the recipe). None: return a ``DatasetSpec`` for
            ``mix_dataset`` to build.
        source: ``json`` / ``parquet`` / ``text`` / ``csv`` with ``data_files``, a local file
            path (its suffix decides: ``.json``, ``.jsonl``, ``.parquet``, ``.txt``, ``.csv``,
            ``.arrow``), a local folder, or a hub dataset id.
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
        allow_unknown_tokens: Build even when more than half of the content tokens of the first
            samples are the tokenizer's unknown or padding token (by default that stops the
            build: the tokenizer does not fit the data).
        num_proc: Processes that tokenize, on local rank 0 only (default ``min(8, cpu
            count)``; small sources use fewer). With ``streaming``: DataLoader worker
            processes per rank that read and tokenize the next windows during the training
            steps (default 1).
        cache_dir: Where tokenized datasets are cached (default: ``tunelab/`` in the
            ``datasets`` cache).
        streaming: Read, tokenize and pack the rows on the fly instead of tokenizing them
            ahead into the cache (``tunelab.data.streaming``); needs ``max_steps_per_epoch``.
        shuffle_buffer_size: Rows per shuffle window of a stream (default 1000; 1: in order).
        **load_dataset_kwargs: Passed to ``datasets.load_dataset``.

    Returns:
        The dataset.

    Raises:
        ConfigError: For an unknown template or column_map key, packing without a length, or
            ``auto`` with a tokenizer that has no chat template.
        DataError: For a missing file or column, or a malformed row (file, line, 0-based row,
            column), including a row the chat template refuses.
    """
    if tokenizer is None:
        return DatasetSpec.capture(instruct_dataset, locals())
    max_seq_len = _check_lengths(tokenizer, max_seq_len, packed)
    chosen = resolve_template(tokenizer, template, template_kwargs)
    columns = resolve_columns(
        {"instruction": "instruction", "input": "input", "output": "output"},
        column_map,
        "instruct_dataset",
    )
    render = Render(tokenizer, chosen, template_kwargs, train_on_input, max_seq_len)

    def rows_for(name: str, present: list[str]) -> InstructRows:
        require_columns(name, present, [columns["instruction"], columns["output"]])
        return InstructRows(render, columns)

    settings = dict(
        template=template,
        template_kwargs=template_kwargs,
        train_on_input=train_on_input,
        max_seq_len=max_seq_len,
        columns=columns,
    )
    return build_tokenized(
        tokenizer,
        builder="instruct_dataset",
        settings=settings,
        rows_for=rows_for,
        sources=resolve_sources(source, data_files, split, **load_dataset_kwargs),
        skip_malformed=skip_malformed,
        packed=packed,
        max_seq_len=max_seq_len,
        num_proc=num_proc,
        cache_dir=cache_dir,
        allow_unknown_tokens=allow_unknown_tokens,
        streaming=streaming,
        shuffle_buffer_size=shuffle_buffer_size,
    )


def chat_dataset(
    tokenizer: Tokenizer | None = None,
    *,
    source: str,
    data_files: Any = None,
    split: str = "train",
    conversation_column: str | None = None,
    conversation_style: str = "auto",
    template: str = "auto",
    template_kwargs: dict[str, Any] | None = None,
    train_on_input: bool = False,
    train_on_reasoning: bool = True,
    max_seq_len: int | None = None,
    packed: bool = False,
    skip_malformed: bool = False,
    allow_unknown_tokens: bool = False,
    num_proc: int | None = None,
    cache_dir: str | None = None,
    streaming: bool = False,
    shuffle_buffer_size: int | None = None,
    **load_dataset_kwargs: Any,
) -> TokenizedDataset | StreamingDataset | DatasetSpec:
    """Conversations as SFT samples; by default only assistant turns are trained.

    With ``template: auto`` (the default) each conversation is rendered with the tokenizer's
    own chat template, and assistant turns are trained as that template renders them; a
    template that re-renders earlier turns once later ones exist gives one sample per
    assistant turn (see ``tunelab.data.chat``).

    The layout is found from the columns: OpenAI ``messages`` (a list of ``{"role",
    "content"}``), else ShareGPT ``conversations`` (a list of ``{"from", "value"}`` with
    ``human`` / ``gpt`` / ``system``).

    Args:
        tokenizer: The tokenizer (passed by the recipe). None: return a ``DatasetSpec`` for
            ``mix_dataset`` to build.
        source: As for ``instruct_dataset``.
        data_files: File path(s) for a loader ``source``.
        split: Split to read.
        conversation_column: The column holding each conversation (a list of messages);
            None: ``messages``, else ``conversations``, whichever the source has.
        conversation_style: ``auto`` (per conversation: ShareGPT when its messages have
            ``from`` / ``value`` and no ``role`` / ``content``, else OpenAI), ``openai``
            (``{"role", "content"}``; system/user/assistant) or ``sharegpt`` (``{"from",
            "value"}``; system/human/gpt).
        template: ``auto`` (the tokenizer's chat template), or for a base model ``chatml``,
            ``llama3``, ``instruct`` or ``alpaca``.
        template_kwargs: Extra variables for the chat template (``auto`` only), e.g.
            ``{"enable_thinking": False}``.
        train_on_input: Also train on system and user turns (with ``auto``: on every token but
            the first).
        train_on_reasoning: Train on the reasoning (``reasoning_content`` / ``thinking``) of
            assistant turns where the template renders it; false keeps it as context only.
        max_seq_len: Cut samples to this many tokens (default: the tokenizer's).
        packed: Pack samples into ``max_seq_len`` sequences.
        skip_malformed: Skip malformed rows (counted in ``num_skipped``) instead of raising.
        allow_unknown_tokens: Build even when more than half of the content tokens of the first
            samples are the tokenizer's unknown or padding token (by default that stops the
            build: the tokenizer does not fit the data).
        num_proc: As for ``instruct_dataset``.
        cache_dir: As for ``instruct_dataset``.
        streaming: Read, tokenize and pack the rows on the fly instead of tokenizing them
            ahead into the cache (``tunelab.data.streaming``); needs ``max_steps_per_epoch``.
        shuffle_buffer_size: Rows per shuffle window of a stream (default 1000; 1: in order).
        **load_dataset_kwargs: Passed to ``datasets.load_dataset``.

    Returns:
        The dataset.

    Raises:
        ConfigError: For an unknown template or style, packing without a length, or ``auto``
            with a tokenizer that has no chat template.
        DataError: For a missing file or column, or a malformed row (file, line, 0-based row,
            column), including a conversation the chat template refuses.
    """
    if tokenizer is None:
        return DatasetSpec.capture(chat_dataset, locals())
    if conversation_style not in STYLES:
        raise ConfigError(
            f"conversation_style must be 'auto', 'openai' or 'sharegpt', got {conversation_style!r}"
        )
    max_seq_len = _check_lengths(tokenizer, max_seq_len, packed)
    chosen = resolve_template(tokenizer, template, template_kwargs)
    render = Render(
        tokenizer, chosen, template_kwargs, train_on_input, max_seq_len, train_on_reasoning
    )

    def rows_for(name: str, present: list[str]) -> ChatRows:
        column = conversation_column_of(name, present, conversation_column)
        return ChatRows(render, column, conversation_style)

    settings = dict(
        template=template,
        template_kwargs=template_kwargs,
        train_on_input=train_on_input,
        train_on_reasoning=train_on_reasoning,
        max_seq_len=max_seq_len,
        conversation_column=conversation_column,
        conversation_style=conversation_style,
    )
    return build_tokenized(
        tokenizer,
        builder="chat_dataset",
        settings=settings,
        rows_for=rows_for,
        sources=resolve_sources(source, data_files, split, **load_dataset_kwargs),
        skip_malformed=skip_malformed,
        packed=packed,
        max_seq_len=max_seq_len,
        num_proc=num_proc,
        cache_dir=cache_dir,
        allow_unknown_tokens=allow_unknown_tokens,
        streaming=streaming,
        shuffle_buffer_size=shuffle_buffer_size,
    )


def text_dataset(
    tokenizer: Tokenizer | None = None,
    *,
    source: str,
    data_files: Any = None,
    split: str = "train",
    column: str = "text",
    max_seq_len: int | None = None,
    packed: bool = False,
    skip_malformed: bool = False,
    allow_unknown_tokens: bool = False,
    num_proc: int | None = None,
    cache_dir: str | None = None,
    streaming: bool = False,
    shuffle_buffer_size: int | None = None,
    **load_dataset_kwargs: Any,
) -> TokenizedDataset | StreamingDataset | DatasetSpec:
    """Plain text (continued pre-training): every token trained, each row BOS + text + EOS.

    Args:
        tokenizer: The tokenizer (passed by the recipe). None: return a ``DatasetSpec`` for
            ``mix_dataset`` to build.
        source: As for ``instruct_dataset``; ``text`` files give one row per line.
        data_files: File path(s) for a loader ``source``.
        split: Split to read.
        column: The text column.
        max_seq_len: Cut samples to this many tokens (default: the tokenizer's).
        packed: Pack samples into ``max_seq_len`` sequences.
        skip_malformed: Skip malformed (e.g. empty) rows instead of raising.
        allow_unknown_tokens: As for ``instruct_dataset``.
        num_proc: As for ``instruct_dataset``.
        cache_dir: As for ``instruct_dataset``.
        streaming: Read, tokenize and pack the rows on the fly instead of tokenizing them
            ahead into the cache (``tunelab.data.streaming``); needs ``max_steps_per_epoch``.
        shuffle_buffer_size: Rows per shuffle window of a stream (default 1000; 1: in order).
        **load_dataset_kwargs: Passed to ``datasets.load_dataset``.

    Returns:
        The dataset.

    Raises:
        ConfigError: If packing without a length.
        DataError: For a missing file or column, or a malformed row.
    """
    if tokenizer is None:
        return DatasetSpec.capture(text_dataset, locals())
    max_seq_len = _check_lengths(tokenizer, max_seq_len, packed)

    def rows_for(name: str, present: list[str]) -> TextRows:
        require_columns(name, present, [column])
        return TextRows(tokenizer, column, max_seq_len)

    return build_tokenized(
        tokenizer,
        builder="text_dataset",
        settings=dict(column=column, max_seq_len=max_seq_len),
        rows_for=rows_for,
        sources=resolve_sources(source, data_files, split, **load_dataset_kwargs),
        skip_malformed=skip_malformed,
        packed=packed,
        max_seq_len=max_seq_len,
        num_proc=num_proc,
        cache_dir=cache_dir,
        allow_unknown_tokens=allow_unknown_tokens,
        streaming=streaming,
        shuffle_buffer_size=shuffle_buffer_size,
    )
