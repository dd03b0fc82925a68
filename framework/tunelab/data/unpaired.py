"""Unpaired, labelled completions for KTO, each with its mismatched pair for the KL estimate.

A row is one completion and a label: ``prompt`` + ``completion`` + ``label`` (each of prompt and
completion a string or a list of chat messages), or a ``messages`` conversation whose final
assistant turn is the completion, + ``label``. ``label`` is ``true`` (desirable, thumbs up) or
``false`` (undesirable). The prompt is masked: only the completion is scored.

KTO's reference point ``z0`` is estimated from mismatched pairs (Ethayarajh et al. 2024, and
TRL's KTOTrainer): item ``i`` is also given prompt ``x_i`` followed by the completion of item
``i - 1`` (item 0 takes the last item's), like TRL's rotation by one. The pairing is by dataset
index, not by batch, so it does not depend on the shuffle, the batch size or the number of
processes: a run on 2 processes equals one on 1 process with twice the accumulation, and a
resumed run sees the same pairs.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from tunelab.data.chat_template import ChatTemplate
from tunelab.data.conversations import check_parts, read_documents, read_part, read_tools
from tunelab.data.preference import _read_turns, _tokenize_side
from tunelab.data.rows import (
    IGNORE_INDEX,
    BadRow,
    check_answer,
    read_messages,
    require_columns,
    resolve_columns,
    text_bound,
    to_messages,
    to_sample,
)
from tunelab.data.sft import resolve_template
from tunelab.data.sources import resolve_sources
from tunelab.data.templates import Template, tokenize_messages
from tunelab.data.tokenized import TokenizedDataset, build_tokenized
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import ConfigError, DataError


def _read_label(row: dict[str, Any], column: str) -> bool:
    value = row.get(column)
    if value is None:
        raise BadRow(column, "missing label: give true (desirable) or false (undesirable)")
    if not isinstance(value, bool):
        raise BadRow(column, f"label must be true or false, got {value!r}")
    return value


@dataclass
class UnpairedRows:
    """Row function of ``kto_dataset``: one labelled completion.

    Attributes:
        prompt_column: The prompt column, or None for the ``messages`` layout (the prompt is
            every message before the final assistant turn).
    """

    tokenizer: Tokenizer
    template: Template | ChatTemplate
    template_kwargs: Mapping[str, Any] | None
    max_seq_len: int | None
    columns: dict[str, str]
    prompt_column: str | None

    @property
    def max_chars(self) -> int | None:
        """Characters of a text that can reach a sample (``text_bound``)."""
        return text_bound(self.tokenizer.longest_token_chars, self.max_seq_len)

    def _split_conversation(self, messages: list[Any], column: str) -> tuple[list, list]:
        last = messages[-1]
        role = last[0] if isinstance(last, tuple) else last["role"]
        if role != "assistant" or len(messages) < 2:
            raise BadRow(
                column, "the final message must be the assistant's completion, after a prompt"
            )
        return messages[:-1], messages[-1:]

    def _chat(self, row: dict[str, Any]) -> tuple[list[int], list[bool]]:
        if self.prompt_column is None:
            column = self.columns["messages"]
            prompt, answer = self._split_conversation(
                read_part(row.get(column), column, "assistant"), column
            )
        else:
            column = self.columns["completion"]
            prompt = read_part(row.get(self.prompt_column), self.prompt_column, "user")
            answer = read_part(row.get(column), column, "assistant")
        tools, documents = read_tools(row, "tools"), read_documents(row, "documents")
        check_parts(prompt + answer, len(prompt), self.prompt_column or column, column, tools)
        return _tokenize_side(
            self.tokenizer, self.template, prompt + answer, len(prompt),
            self.template_kwargs, column, tools, documents,
        )  # fmt: skip

    def _named(self, row: dict[str, Any]) -> tuple[list[int], list[bool]]:
        if self.prompt_column is None:
            column = self.columns["messages"]
            prompt, answer = self._split_conversation(
                read_messages(row.get(column), column), column
            )
        else:
            column = self.columns["completion"]
            prompt = _read_turns(row, self.prompt_column, "user")
            answer = _read_turns(row, column, "assistant")
        check_answer(answer, column)
        messages = to_messages(prompt, False) + to_messages(answer, False)
        return tokenize_messages(self.tokenizer, messages, self.template)

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The row's item, with ``desirable`` (``[1]`` or ``[0]``); raises ``BadRow``."""
        desirable = _read_label(row, self.columns["label"])
        chat = isinstance(self.template, ChatTemplate)
        tokens, mask = self._chat(row) if chat else self._named(row)
        sample, cut = to_sample(tokens, mask, self.max_seq_len)
        trained = any(label != IGNORE_INDEX for label in sample["labels"])
        return [{**sample, "desirable": [int(desirable)], "truncated": cut, "completion": trained}]


def _completion_start(labels: list[int]) -> int:
    return next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)


class MismatchedPairs(Dataset):
    """Unpaired items with their mismatched pair: prompt ``i``, completion of item ``i - 1``.

    The completion of an item starts at its first trained token; the mismatched pair is this
    item's tokens before that point followed by the other item's from its own, cut to
    ``max_seq_len`` like every sample. The counts of the wrapped dataset (``num_skipped``, ...)
    read through.

    Args:
        dataset: The tokenized unpaired items (``tokens``, ``labels``, ``desirable``).
        max_seq_len: Cut of the mismatched pairs.
    """

    def __init__(self, dataset: TokenizedDataset, max_seq_len: int | None) -> None:
        self.dataset = dataset
        self.max_seq_len = max_seq_len

    def __getattr__(self, name: str) -> Any:
        """Counts and helpers of the wrapped dataset (``num_skipped``, ``num_longer_than``)."""
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __len__(self) -> int:
        """Number of items."""
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Item ``index``: ``tokens``, ``labels``, ``kl_tokens``, ``kl_labels``, ``desirable``."""
        own = self.dataset[index]
        other = self.dataset[(index - 1) % len(self.dataset)]
        prompt_end, completion_start = (
            _completion_start(own["labels"]),
            _completion_start(other["labels"]),
        )
        kl_tokens = list(own["tokens"][:prompt_end]) + list(other["tokens"][completion_start:])
        kl_labels = [IGNORE_INDEX] * prompt_end + list(other["labels"][completion_start:])
        if self.max_seq_len is not None:
            kl_tokens, kl_labels = kl_tokens[: self.max_seq_len], kl_labels[: self.max_seq_len]
        return {
            "tokens": list(own["tokens"]),
            "labels": list(own["labels"]),
            "kl_tokens": kl_tokens,
            "kl_labels": kl_labels,
            "desirable": bool(own["desirable"][0]),
        }


def kto_dataset(
    tokenizer: Tokenizer,
    *,
    source: str,
    data_files: Any = None,
    split: str = "train",
    column_map: dict[str, str] | None = None,
    template: str = "auto",
    template_kwargs: dict[str, Any] | None = None,
    max_seq_len: int | None = None,
    skip_malformed: bool = False,
    allow_unknown_tokens: bool = False,
    num_proc: int | None = None,
    cache_dir: str | None = None,
    **load_dataset_kwargs: Any,
) -> MismatchedPairs:
    """Labelled completions for KTO, each with its mismatched pair (see the module docstring).

    Args:
        tokenizer: The tokenizer (passed by the recipe).
        source: ``json`` / ``parquet`` / ``csv`` with ``data_files``, a local file path (its
            suffix decides), a local folder, or a hub dataset id.
        data_files: File path(s) for a loader ``source``.
        split: Split to read.
        column_map: Our column name to the file's; keys among ``prompt``, ``completion``,
            ``label``, ``messages``. With a ``prompt`` column the layout is prompt /
            completion / label, else messages / label.
        template: ``auto`` (the tokenizer's chat template), or for a base model ``chatml``,
            ``llama3``, ``instruct`` or ``alpaca``.
        template_kwargs: Extra variables for the chat template (``auto`` only).
        max_seq_len: Cut each sequence to this many tokens, keeping the start (default: the
            tokenizer's).
        skip_malformed: Skip malformed rows (counted in ``num_skipped``) instead of raising.
        allow_unknown_tokens: As for ``instruct_dataset``.
        num_proc: Processes that tokenize, on local rank 0 only.
        cache_dir: Where tokenized datasets are cached.
        **load_dataset_kwargs: Passed to ``datasets.load_dataset``.

    Returns:
        The dataset, with ``num_skipped``, ``num_truncated`` and ``num_dropped``.

    Raises:
        ConfigError: For an unknown template or column_map key, or a non-positive length.
        DataError: For a missing file or column, a malformed row (file, line, 0-based row,
            column: a missing or non-boolean label, an empty completion, a conversation not
            ending with the assistant), or fewer than 2 usable rows (no mismatched pair).
    """
    max_seq_len = max_seq_len if max_seq_len is not None else tokenizer.max_seq_len
    if max_seq_len is not None and max_seq_len < 1:
        raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
    chosen_template = resolve_template(tokenizer, template, template_kwargs)
    columns = resolve_columns(
        {"prompt": "prompt", "completion": "completion", "label": "label", "messages": "messages"},
        column_map,
        "kto_dataset",
    )

    def rows_for(name: str, present: list[str]) -> UnpairedRows:
        if columns["prompt"] in present:
            require_columns(name, present, [columns["completion"], columns["label"]])
            prompt_column = columns["prompt"]
        else:
            require_columns(name, present, [columns["messages"], columns["label"]])
            prompt_column = None
        return UnpairedRows(
            tokenizer, chosen_template, template_kwargs, max_seq_len, columns, prompt_column
        )

    settings = dict(
        template=template, template_kwargs=template_kwargs, max_seq_len=max_seq_len, columns=columns
    )
    tokenized = build_tokenized(
        tokenizer,
        builder="kto_dataset",
        kind="unpaired",
        settings=settings,
        rows_for=rows_for,
        sources=resolve_sources(source, data_files, split, **load_dataset_kwargs),
        skip_malformed=skip_malformed,
        max_seq_len=max_seq_len,
        num_proc=num_proc,
        cache_dir=cache_dir,
        allow_unknown_tokens=allow_unknown_tokens,
        describe=source,
    )
    if len(tokenized) < 2:
        raise DataError(
            f"{source}: KTO needs at least 2 usable rows (a completion is paired with another "
            f"row's prompt to estimate the KL term), got {len(tokenized)}"
        )
    return MismatchedPairs(tokenized, max_seq_len)
