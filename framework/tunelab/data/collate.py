"""Collate functions: lists of items into right-padded tensors.

Use with a ``DataLoader`` through ``functools.partial(padded_collate_sft, pad_id=...)``.
"""

from typing import Any

import torch


def _pad(rows: list[list[int]], length: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def padded_collate_sft(
    batch: list[dict[str, Any]], pad_id: int, ignore_index: int = -100
) -> dict[str, torch.Tensor]:
    """Right-pad SFT items to the longest in the batch.

    Args:
        batch: Items with ``tokens`` and ``labels``; packed items also carry ``input_pos`` and
            ``document_ids``, which are stacked too.
        pad_id: Token id of padding.
        ignore_index: Label of padding.

    Returns:
        ``tokens`` and ``labels`` LongTensors ``[batch, seq]``, ``token_mask`` (bool
        ``[batch, seq]``: True at an item's tokens, False at padding; what a mixture-of-experts
        router's load-balancing loss counts); for packed items also ``input_pos`` and
        ``document_ids`` ``[batch, seq]``. Padded positions of packed items (only when packs
        differ in length) take their column index as position and a document id of their own.
        Items that carry ``pair_index`` (their dataset index, ``IndexedPairs``) give
        ``pair_index`` LongTensor ``[batch]``.
    """
    length = max(len(item["tokens"]) for item in batch)
    lengths = torch.tensor([len(item["tokens"]) for item in batch])
    out = {
        "tokens": _pad([item["tokens"] for item in batch], length, pad_id),
        "labels": _pad([item["labels"] for item in batch], length, ignore_index),
        "token_mask": torch.arange(length)[None, :] < lengths[:, None],
    }
    if "input_pos" in batch[0]:
        input_pos = torch.arange(length).repeat(len(batch), 1)
        document_ids = torch.empty(len(batch), length, dtype=torch.long)
        for i, item in enumerate(batch):
            n = len(item["input_pos"])
            input_pos[i, :n] = torch.as_tensor(item["input_pos"])
            document_ids[i, :n] = torch.as_tensor(item["document_ids"])
            document_ids[i, n:] = max(item["document_ids"], default=-1) + 1
        out["input_pos"] = input_pos
        out["document_ids"] = document_ids
    if "pair_index" in batch[0]:
        out["pair_index"] = torch.tensor([item["pair_index"] for item in batch], dtype=torch.long)
    return out


def padded_collate_dpo(
    batch: list[dict[str, Any]], pad_id: int, ignore_index: int = -100
) -> dict[str, torch.Tensor]:
    """Collate preference pairs into one batch: all chosen rows, then all rejected rows.

    The policy then runs one forward over ``2B`` rows; row ``i`` and row ``B + i`` are the two
    sides of pair ``i``.

    Args:
        batch: Items with ``chosen_tokens``, ``chosen_labels``, ``rejected_tokens``,
            ``rejected_labels`` (and optionally ``pair_index``).
        pad_id: Token id of padding.
        ignore_index: Label of padding.

    Returns:
        ``tokens`` and ``labels`` LongTensors ``[2 * batch, seq]``, padded to the longest side;
        when the items carry ``pair_index`` (their dataset index, from
        ``tunelab.data.preference.IndexedPairs``), also ``pair_index`` LongTensor ``[batch]``;
        when they carry ``margin`` (``[value]``, a margin column), also ``margin`` float64
        ``[batch]``.
    """
    tokens = [item["chosen_tokens"] for item in batch] + [item["rejected_tokens"] for item in batch]
    labels = [item["chosen_labels"] for item in batch] + [item["rejected_labels"] for item in batch]
    length = max(len(row) for row in tokens)
    out = {"tokens": _pad(tokens, length, pad_id), "labels": _pad(labels, length, ignore_index)}
    if "pair_index" in batch[0]:
        out["pair_index"] = torch.tensor([item["pair_index"] for item in batch], dtype=torch.long)
    if "margin" in batch[0]:
        out["margin"] = torch.tensor([item["margin"][0] for item in batch], dtype=torch.float64)
    return out


def padded_collate_kto(
    batch: list[dict[str, Any]], pad_id: int, ignore_index: int = -100
) -> dict[str, torch.Tensor]:
    """Collate KTO items in a preference batch's layout: completions, then mismatched pairs.

    Row ``i`` is item ``i``'s prompt and completion, row ``B + i`` its mismatched pair (its
    prompt, another item's completion), so DPO's reference machinery reads the batch as it
    reads pairs (``chosen`` the completions, ``rejected`` the mismatched pairs).

    Args:
        batch: Items of ``tunelab.data.kto_dataset`` (``tokens``, ``labels``, ``kl_tokens``,
            ``kl_labels``, ``desirable``; optionally ``pair_index``).
        pad_id: Token id of padding.
        ignore_index: Label of padding.

    Returns:
        ``tokens`` and ``labels`` LongTensors ``[2 * batch, seq]``, ``desirable`` bool
        ``[batch]``, and ``pair_index`` ``[batch]`` when the items carry it.
    """
    tokens = [item["tokens"] for item in batch] + [item["kl_tokens"] for item in batch]
    labels = [item["labels"] for item in batch] + [item["kl_labels"] for item in batch]
    length = max(len(row) for row in tokens)
    out = {
        "tokens": _pad(tokens, length, pad_id),
        "labels": _pad(labels, length, ignore_index),
        "desirable": torch.tensor([bool(item["desirable"]) for item in batch], dtype=torch.bool),
    }
    if "pair_index" in batch[0]:
        out["pair_index"] = torch.tensor([item["pair_index"] for item in batch], dtype=torch.long)
    return out
