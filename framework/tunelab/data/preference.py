"""Preference pairs (prompt / chosen / rejected) for DPO and its family.

Each of prompt, chosen and rejected is a string or a list of chat messages. A string prompt is
one user message and a string answer one assistant message. Two layouts, found from the
columns:

- with a ``prompt`` column, the prompt is shared and chosen / rejected are the answers (when
  both answers are conversations that repeat the prompt's messages first, as in
  UltraFeedback, the repeat is dropped);
- without one, chosen and rejected are whole conversations, and the prompt is the messages
  they start with in common (as in Anthropic HH): the rest of each is its answer.

The prompt is always masked: the
losses score only the completion. Truncation to ``max_seq_len`` keeps the start (the prompt)
and cuts the end; the dataset reports how many pairs were cut (``num_truncated``) and drops
pairs left without a completion token on either side (``num_dropped``), whose log-probability
would be empty (and whose length-normalised losses would divide by zero).

With ``template: auto`` (the default) both sides are rendered with the tokenizer's own chat
template and only the answer's assistant turns are trained, as that template renders them.
Messages may then carry tool calls, tool results and reasoning (``reasoning_content``), as
``chat_dataset``'s rows do (``tunelab.data.conversations``), and a row's ``tools`` (JSON
schemas) and ``documents`` columns are passed to the template: an agentic pair's prompt can end
with a call and its result, and the answers differ in the calls they make. Named formats take
``(role, content)`` messages only.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from tunelab.data.chat import tokenize_conversation
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError
from tunelab.data.conversations import check_parts, read_documents, read_part, read_tools
from tunelab.data.mix import DatasetSpec
from tunelab.data.rows import (
    IGNORE_INDEX,
    BadRow,
    check_answer,
    conversation_style,
    read_messages,
    read_text,
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
from tunelab.errors import ConfigError


def _read_turns(row: dict[str, Any], column: str, default_role: str) -> list[tuple[str, str]]:
    """A string cell as one ``default_role`` message, a list cell as messages."""
    value = row.get(column)
    if isinstance(value, str) or value is None:
        return [(default_role, read_text(row, column))]
    return read_messages(value, column)


def _tokenize_side(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    num_prompt: int,
    template_kwargs: Mapping[str, Any] | None,
    column: str,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[bool]]:
    """One side of a pair with the chat template: only the answer's assistant turns trained."""
    answer_turns = [
        i for i, m in enumerate(messages) if i >= num_prompt and m["role"] == "assistant"
    ]
    try:
        samples = tokenize_conversation(
            tokenizer,
            messages,
            trained_turns=answer_turns,
            tools=tools,
            documents=documents,
            template_kwargs=template_kwargs,
            template=template,
        )
    except ChatTemplateError as error:
        raise BadRow(column, str(error)) from None
    if len(samples) != 1:
        raise BadRow(
            column,
            f"chat template {template.source} re-renders earlier turns once later ones exist, "
            "so an answer of several assistant turns is not one sequence; give one turn",
        )
    return samples[0]


Pairs = list[Any]  # (role, content) pairs, or message dicts with a chat template


def _shared_prefix(chosen: Pairs, rejected: Pairs, column: str) -> tuple[Pairs, Pairs, Pairs]:
    """``(prompt, chosen answer, rejected answer)``: the prompt is the common first messages.

    Raises:
        BadRow: If the two conversations do not start with the same message.
    """
    common = 0
    while common < min(len(chosen), len(rejected)) and chosen[common] == rejected[common]:
        common += 1
    if common == 0:
        raise BadRow(
            column,
            "chosen and rejected start with different messages; without a prompt column the "
            "prompt is the messages both conversations start with",
        )
    return chosen[:common], chosen[common:], rejected[common:]


@dataclass
class PreferenceRows:
    """Row function of ``preference_dataset``: one pair.

    Attributes:
        prompt_column: The prompt column, or None when the source has none (the prompt is
            the shared start of chosen and rejected).
    """

    tokenizer: Tokenizer
    template: Template | ChatTemplate
    template_kwargs: Mapping[str, Any] | None
    max_seq_len: int | None
    columns: dict[str, str]
    prompt_column: str | None
    margin_column: str | None = None

    @property
    def max_chars(self) -> int | None:
        """Characters of a text that can reach a sample (``text_bound``)."""
        return text_bound(self.tokenizer.longest_token_chars, self.max_seq_len)

    def _chat_sides(self, row: dict[str, Any]) -> dict[str, tuple[list[int], list[bool]]]:
        """Both sides with the chat template; messages may carry tool calls and reasoning.

        The prompt and the answers are read as ``chat_dataset`` reads a conversation (tool
        calls, tool results, ``reasoning_content``), with the row's ``tools`` and
        ``documents``, and rendered by the template as ``apply_chat_template`` renders them.
        """
        chosen_column, rejected_column = self.columns["chosen"], self.columns["rejected"]
        if self.prompt_column is None:
            for column in (chosen_column, rejected_column):
                conversation_style(row.get(column), column, "auto")  # a list of messages
            prompt, chosen, rejected = _shared_prefix(
                read_part(row.get(chosen_column), chosen_column, "assistant"),
                read_part(row.get(rejected_column), rejected_column, "assistant"),
                chosen_column,
            )
        else:
            prompt = read_part(row.get(self.prompt_column), self.prompt_column, "user")
            chosen = read_part(row.get(chosen_column), chosen_column, "assistant")
            rejected = read_part(row.get(rejected_column), rejected_column, "assistant")
            size = len(prompt)
            if chosen[:size] == prompt and rejected[:size] == prompt:
                chosen, rejected = chosen[size:], rejected[size:]
        tools, documents = read_tools(row, "tools"), read_documents(row, "documents")
        sides = {}
        for side, answer in (("chosen", chosen), ("rejected", rejected)):
            column = self.columns[side]
            check_parts(prompt + answer, len(prompt), self.prompt_column or column, column, tools)
            sides[side] = _tokenize_side(
                self.tokenizer, self.template, prompt + answer, len(prompt),
                self.template_kwargs, column, tools, documents,
            )  # fmt: skip
        return sides

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The pair's item, with ``truncated``, ``completion`` (and ``margin``); raises ``BadRow``."""
        items = self._items(row)
        if self.margin_column is not None:
            items[0]["margin"] = [_read_margin(row, self.margin_column)]
        return items

    def _items(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        if isinstance(self.template, ChatTemplate):
            return [self._item(self._chat_sides(row))]
        chosen_column, rejected_column = self.columns["chosen"], self.columns["rejected"]
        if self.prompt_column is None:
            prompt, chosen, rejected = _shared_prefix(
                read_messages(row.get(chosen_column), chosen_column),
                read_messages(row.get(rejected_column), rejected_column),
                chosen_column,
            )
        else:
            prompt = _read_turns(row, self.prompt_column, "user")
            chosen = _read_turns(row, chosen_column, "assistant")
            rejected = _read_turns(row, rejected_column, "assistant")
            size = len(prompt)
            if chosen[:size] == prompt and rejected[:size] == prompt:
                # Both answers repeat the prompt (UltraFeedback's layout): once is enough.
                chosen, rejected = chosen[size:], rejected[size:]
        prompt_messages = to_messages(prompt, False)
        sides = {}
        for side, answer in (("chosen", chosen), ("rejected", rejected)):
            check_answer(answer, self.columns[side])
            messages = prompt_messages + to_messages(answer, False)
            sides[side] = tokenize_messages(self.tokenizer, messages, self.template)
        return [self._item(sides)]

    def _item(self, sides: dict[str, tuple[list[int], list[bool]]]) -> dict[str, Any]:
        """The pair's item from both sides' ids and masks, cut to ``max_seq_len``."""
        item: dict[str, Any] = {"truncated": False, "completion": True}
        for side, (tokens, mask) in sides.items():
            sample, cut = to_sample(tokens, mask, self.max_seq_len)
            item[f"{side}_tokens"], item[f"{side}_labels"] = sample["tokens"], sample["labels"]
            item["truncated"] = item["truncated"] or cut
            trained = any(label != IGNORE_INDEX for label in sample["labels"])
            item["completion"] = item["completion"] and trained
        return item


def _read_margin(row: dict[str, Any], column: str) -> float:
    """A pair's margin: a finite number (a reward model's loss wants ``r_c - r_r`` above it)."""
    value = row.get(column)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRow(column, f"expected a finite number (the pair's margin), got {value!r}")
    return float(value)


def preference_dataset(
    tokenizer: Tokenizer | None = None,
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
) -> TokenizedDataset | DatasetSpec:
    """Preference pairs as ``chosen_tokens`` / ``chosen_labels`` / ``rejected_*`` items.

    Args:
        tokenizer: The tokenizer (passed by the recipe). None: return a ``DatasetSpec`` for
            ``mix_dataset`` to build.
        source: ``json`` / ``parquet`` / ``csv`` with ``data_files``, a local file path (its
            suffix decides), a local folder, or a hub dataset id.
        data_files: File path(s) for a loader ``source``.
        split: Split to read.
        column_map: Our column name to the file's; keys among ``prompt``, ``chosen``,
            ``rejected``, ``margin`` (a number per pair, the margin of a reward model's
            loss; read only when named here, e.g. ``{margin: margin}``). Without a ``prompt`` column (and no ``prompt`` key here), chosen and
            rejected are conversations whose shared first messages are the prompt.
        template: ``auto`` (the tokenizer's chat template), or for a base model ``chatml``,
            ``llama3``, ``instruct`` or ``alpaca``.
        template_kwargs: Extra variables for the chat template (``auto`` only).
        max_seq_len: Cut each side to this many tokens, keeping the start (default: the
            tokenizer's).
        skip_malformed: Skip malformed rows (counted in ``num_skipped``) instead of raising.
        allow_unknown_tokens: As for ``instruct_dataset``.
        num_proc: Processes that tokenize, on local rank 0 only (default ``min(8, cpu
            count)``; small sources use fewer).
        cache_dir: Where tokenized datasets are cached (default: ``tunelab/`` in the
            ``datasets`` cache).
        **load_dataset_kwargs: Passed to ``datasets.load_dataset``.

    Returns:
        The dataset, with ``num_skipped``, ``num_truncated`` and ``num_dropped``.

    Raises:
        ConfigError: For an unknown template or column_map key, a non-positive length, or
            ``auto`` with a tokenizer that has no chat template.
        DataError: For a missing file or column, a malformed row (file, line, 0-based row,
            column; also a row the chat template refuses), or when truncation leaves no pair
            with a completion.
    """
    if tokenizer is None:
        return DatasetSpec.capture(preference_dataset, locals())
    max_seq_len = max_seq_len if max_seq_len is not None else tokenizer.max_seq_len
    if max_seq_len is not None and max_seq_len < 1:
        raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
    chosen_template = resolve_template(tokenizer, template, template_kwargs)
    columns = resolve_columns(
        {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "margin": "margin"},
        column_map,
        "preference_dataset",
    )
    prompt_required = "prompt" in (column_map or {})
    # A margin is read only when column_map names its column: other recipes' data is unchanged.
    with_margin = "margin" in (column_map or {})

    def rows_for(name: str, present: list[str]) -> PreferenceRows:
        needed = [columns["chosen"], columns["rejected"]]
        needed += [columns["margin"]] if with_margin else []
        require_columns(name, present, [columns["prompt"], *needed] if prompt_required else needed)
        prompt_column = columns["prompt"] if columns["prompt"] in present else None
        margin_column = columns["margin"] if with_margin else None
        return PreferenceRows(
            tokenizer, chosen_template, template_kwargs, max_seq_len, columns, prompt_column,
            margin_column,
        )  # fmt: skip

    settings = dict(
        template=template,
        template_kwargs=template_kwargs,
        max_seq_len=max_seq_len,
        columns=columns,
        prompt_required=prompt_required,
    )
    return build_tokenized(
        tokenizer,
        builder="preference_dataset",
        kind="preference_margin" if with_margin else "preference",
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


class IndexedPairs(Dataset):
    """A preference dataset whose items also carry their index in it, as ``pair_index``.

    ``padded_collate_dpo`` then gives each batch the dataset index of its pairs, with which
    precomputed reference log-probs are looked up (``tunelab.training.PrecomputedReference``).

    Args:
        dataset: A map-style preference dataset.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        """Number of pairs."""
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Item ``index`` of the dataset, with ``pair_index`` set to ``index``."""
        return {**self.dataset[index], "pair_index": index}
