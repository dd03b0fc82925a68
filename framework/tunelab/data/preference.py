"""Preference pairs (prompt / chosen / rejected) for DPO and its family.

Each of prompt, chosen and rejected is a string or a list of chat messages. A string prompt is
one user message and a string answer one assistant message. The prompt is always masked: the
losses score only the completion. Truncation to ``max_seq_len`` keeps the start (the prompt)
and cuts the end; the dataset reports how many pairs were cut (``num_truncated``) and drops
pairs left without a completion token on either side (``num_dropped``), whose log-probability
would be empty (and whose length-normalised losses would divide by zero).

With ``template: auto`` (the default) both sides are rendered with the tokenizer's own chat
template and only the answer's assistant turns are trained, as that template renders them.
"""

from typing import Any

from tunelab.data import _rows
from tunelab.data.chat import tokenize_conversation
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError
from tunelab.data.sft import IGNORE_INDEX, TokenizedDataset, resolve_template, to_sample
from tunelab.data.sources import load_sources
from tunelab.data.templates import Message, tokenize_messages
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import ConfigError, DataError


def _read_turns(row: dict[str, Any], column: str, default_role: str) -> list[tuple[str, str]]:
    """A string cell as one ``default_role`` message, a list cell as messages."""
    value = row.get(column)
    if isinstance(value, str) or value is None:
        return [(default_role, _rows.read_text(row, column))]
    return _rows.read_messages(value, column)


def _tokenize_side(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: list[Message],
    num_prompt: int,
    template_kwargs: dict[str, Any] | None,
    column: str,
) -> tuple[list[int], list[bool]]:
    """One side of a pair with the chat template: only the answer's assistant turns trained."""
    answer_turns = [i for i, m in enumerate(messages) if i >= num_prompt and m.role == "assistant"]
    try:
        samples = tokenize_conversation(
            tokenizer,
            messages,
            trained_turns=answer_turns,
            template_kwargs=template_kwargs,
            template=template,
        )
    except ChatTemplateError as error:
        raise _rows.BadRow(column, str(error)) from None
    if len(samples) != 1:
        raise _rows.BadRow(
            column,
            f"chat template {template.source} re-renders earlier turns once later ones exist, "
            "so an answer of several assistant turns is not one sequence; give one turn",
        )
    return samples[0]


def preference_dataset(
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
    **load_dataset_kwargs: Any,
) -> TokenizedDataset:
    """Preference pairs as ``chosen_tokens`` / ``chosen_labels`` / ``rejected_*`` items.

    Args:
        tokenizer: The tokenizer (passed by the recipe).
        source: ``json`` / ``parquet`` / ``csv`` with ``data_files``, a local file path (its
            suffix decides), a local folder, or a hub dataset id.
        data_files: File path(s) for a loader ``source``.
        split: Split to read.
        column_map: Our column name to the file's; keys among ``prompt``, ``chosen``,
            ``rejected``.
        template: ``auto`` (the tokenizer's chat template), or for a base model ``chatml``,
            ``llama3``, ``instruct`` or ``alpaca``.
        template_kwargs: Extra variables for the chat template (``auto`` only).
        max_seq_len: Cut each side to this many tokens, keeping the start (default: the
            tokenizer's).
        skip_malformed: Skip malformed rows (counted in ``num_skipped``) instead of raising.
        **load_dataset_kwargs: Passed to ``datasets.load_dataset``.

    Returns:
        The dataset, with ``num_skipped``, ``num_truncated`` and ``num_dropped``.

    Raises:
        ConfigError: For an unknown template or column_map key, a non-positive length, or
            ``auto`` with a tokenizer that has no chat template.
        DataError: For a missing file or column, a malformed row (file, 0-based row, column;
            also a row the chat template refuses), or when truncation leaves no pair with a
            completion.
    """
    max_seq_len = max_seq_len if max_seq_len is not None else tokenizer.max_seq_len
    if max_seq_len is not None and max_seq_len < 1:
        raise ConfigError(f"max_seq_len must be positive, got {max_seq_len}")
    chosen_template = resolve_template(tokenizer, template, template_kwargs)
    columns = _rows.resolve_columns(
        {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
        column_map,
        "preference_dataset",
    )
    sources = load_sources(source, data_files, split, **load_dataset_kwargs)
    _rows.require_columns(sources, columns.values())

    def make(row: dict[str, Any]) -> tuple[dict[str, list[int]], bool]:
        prompt = _rows.to_messages(_read_turns(row, columns["prompt"], "user"), False)
        item: dict[str, list[int]] = {}
        cut = False
        for side in ("chosen", "rejected"):
            answer = _read_turns(row, columns[side], "assistant")
            _rows.check_answer(answer, columns[side])
            messages = prompt + _rows.to_messages(answer, False)
            if isinstance(chosen_template, ChatTemplate):
                tokens, mask = _tokenize_side(
                    tokenizer,
                    chosen_template,
                    messages,
                    len(prompt),
                    template_kwargs,
                    columns[side],
                )
            else:
                tokens, mask = tokenize_messages(tokenizer, messages, chosen_template)
            sample, side_cut = to_sample(tokens, mask, max_seq_len)
            item[f"{side}_tokens"], item[f"{side}_labels"] = sample["tokens"], sample["labels"]
            cut = cut or side_cut
        return item, cut

    pairs, num_skipped = _rows.build_samples(sources, make, skip_malformed)

    def has_completion(item: dict[str, list[int]], side: str) -> bool:
        return any(label != IGNORE_INDEX for label in item[f"{side}_labels"])

    kept = [
        item
        for item, _ in pairs
        if has_completion(item, "chosen") and has_completion(item, "rejected")
    ]
    if not kept:
        raise DataError(
            f"{source}: max_seq_len={max_seq_len} leaves no completion token in any pair; "
            "raise max_seq_len"
        )
    return TokenizedDataset(
        kept,
        num_skipped=num_skipped,
        num_truncated=sum(cut for _, cut in pairs),
        num_dropped=len(pairs) - len(kept),
    )
