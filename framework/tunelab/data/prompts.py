"""Prompt datasets for online RL (GRPO): a prompt per row, and every other column for the rewards.

The prompt is a string (one user message) or a list of chat messages; it is rendered with the
tokenizer's chat template and ``add_generation_prompt`` (``template: auto``), with a named
format for a base model, or encoded as raw text (``template: null``). With the chat template the
messages may carry tool calls, tool results and reasoning, and a row's ``tools`` and
``documents`` are passed to it, as ``chat_dataset`` does (``tunelab.data.conversations``). The rows stay as read,
so a reward can read any column (``answer``, test cases, ...).

Rows are read with the same sources as the SFT and preference datasets (JSON/JSONL, parquet,
csv, Arrow, local folders, the hub). Prompt sets are small next to SFT corpora and each rank
reads and renders them itself; the tokenized cache the other datasets use is not used here.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tunelab.data.chat import apply_chat_template
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError
from tunelab.data.conversations import check_parts, read_documents, read_part, read_tools
from tunelab.data.rows import BadRow, read_messages, read_text, to_messages
from tunelab.data.sft import resolve_template
from tunelab.data.sources import resolve_sources
from tunelab.data.templates import tokenize_messages
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import DataError

__all__ = ["PromptDataset", "padded_collate_prompts", "prompt_dataset"]


class PromptDataset(Dataset):
    """Rendered prompts and their rows. Item ``i``: ``{"prompt_tokens": [...], "index": i}``.

    Attributes:
        rows: The rows as read (every column), by index.
        prompts: The rendered prompt texts (what the model sees), by index.
        num_truncated: Prompts cut to ``max_prompt_tokens`` (their start is dropped).
    """

    def __init__(
        self, tokens: list[list[int]], prompts: list[str], rows: list[dict], num_truncated: int
    ) -> None:
        self.tokens, self.prompts, self.rows = tokens, prompts, rows
        self.num_truncated = num_truncated

    def __len__(self) -> int:
        """Number of prompts."""
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """The prompt's token ids and its index."""
        return {"prompt_tokens": self.tokens[index], "index": index}


def _read_rows(source: str, data_files: Any, split: str, **kwargs: Any) -> list[dict]:
    rows: list[dict] = []
    for src in resolve_sources(source, data_files, split, **kwargs):
        with tempfile.TemporaryDirectory() as scratch:
            raw = src.read(Path(scratch) / "rows.arrow")
            if not raw.json_rows:
                rows += [dict(row) for row in raw.dataset]
                continue
            for record in raw.dataset:
                where = f"{src.name}:{record['_line']}" if record["_line"] else src.name
                if record["_problem"]:
                    raise DataError(f"{where}: {record['_problem']}")
                row = json.loads(record["_json"])
                if not isinstance(row, dict):
                    raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
    return rows


def prompt_dataset(
    tokenizer: Tokenizer,
    *,
    source: str,
    data_files: Any = None,
    split: str = "train",
    prompt_column: str = "prompt",
    template: str | None = "auto",
    template_kwargs: dict[str, Any] | None = None,
    max_prompt_tokens: int | None = None,
    **load_dataset_kwargs: Any,
) -> PromptDataset:
    """Prompts to sample completions for, with their rows for the rewards.

    Args:
        tokenizer: The tokenizer (passed by the recipe).
        source: As ``chat_dataset``'s: ``json`` with ``data_files``, a local file or folder,
            or a hub dataset id.
        data_files: File path(s) for a loader ``source``.
        split: Split to read.
        prompt_column: The column with the prompt: a string (one user message) or a list of
            messages. With a chat template they may carry tool calls, tool results and
            reasoning as ``chat_dataset``'s rows do, and the row's ``tools`` (JSON schemas)
            and ``documents`` columns reach the template; named formats take
            ``{"role", "content"}`` messages only.
        template: ``auto`` (the tokenizer's chat template, with ``add_generation_prompt``), a
            named format for a base model (``chatml``, ``llama3``, ``instruct``, ``alpaca``),
            or None for the raw text (a string prompt, with BOS).
        template_kwargs: Extra variables for the chat template (``auto`` only).
        max_prompt_tokens: Keep only the last this many prompt tokens (None: no cut).
        **load_dataset_kwargs: Passed to ``datasets.load_dataset``.

    Returns:
        The dataset.

    Raises:
        DataError: A missing file or column, a malformed row (file:line, column), or a row
            the chat template refuses.
        ConfigError: An unknown template, or ``auto`` with a tokenizer without a template.
    """
    rows = _read_rows(source, data_files, split, **load_dataset_kwargs)
    if not rows:
        raise DataError(f"{source}: no rows")
    chosen = None if template is None else resolve_template(tokenizer, template, template_kwargs)
    tokens, prompts, truncated = [], [], 0
    for number, row in enumerate(rows):
        try:
            ids = _render(tokenizer, chosen, row, prompt_column, template_kwargs)
        except (BadRow, ChatTemplateError) as error:
            raise DataError(f"{source}: row {number}: {error}") from None
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            ids, truncated = ids[-max_prompt_tokens:], truncated + 1
        tokens.append(ids)
        prompts.append(tokenizer.decode(ids, skip_special_tokens=False))
    return PromptDataset(tokens, prompts, rows, truncated)


def _render(
    tokenizer: Tokenizer,
    template: Any,
    row: dict[str, Any],
    column: str,
    template_kwargs: Mapping[str, Any] | None,
) -> list[int]:
    if column not in row:
        raise BadRow(column, f"missing column (the row has {sorted(row)})")
    value = row[column]
    if template is None:
        return tokenizer.encode(read_text(row, column), add_bos=True)
    if isinstance(template, ChatTemplate):
        # Messages as chat_dataset reads them (tool calls, tool results, reasoning), with the
        # row's tools and documents: the prompt as the model is served it.
        messages = read_part(value, column, "user")
        check_parts(messages, len(messages), column)
        return apply_chat_template(
            tokenizer,
            messages,
            add_generation_prompt=True,
            tools=read_tools(row, "tools"),
            documents=read_documents(row, "documents"),
            template_kwargs=template_kwargs,
            template=template,
        )
    pairs = [("user", read_text(row, column))] if isinstance(value, str) else None
    pairs = pairs or read_messages(value, column)
    messages = to_messages(pairs, train_on_input=False)
    ids, _ = tokenize_messages(tokenizer, messages, template, add_generation_prompt=True)
    return ids


def padded_collate_prompts(batch: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompts of a micro-batch, each at the start of its row (padded after: see the engine).

    Returns:
        ``prompt_tokens`` ``[batch, longest]``, ``prompt_lengths`` ``[batch]`` and ``index``
        ``[batch]`` (the dataset index of each prompt).
    """
    width = max(len(item["prompt_tokens"]) for item in batch)
    tokens = torch.full((len(batch), width), pad_id, dtype=torch.long)
    for row, item in enumerate(batch):
        tokens[row, : len(item["prompt_tokens"])] = torch.tensor(item["prompt_tokens"])
    return {
        "prompt_tokens": tokens,
        "prompt_lengths": torch.tensor([len(item["prompt_tokens"]) for item in batch]),
        "index": torch.tensor([item["index"] for item in batch]),
    }
