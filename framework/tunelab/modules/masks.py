"""Boolean attention masks: ``True`` means the query may attend to the key.

All masks are ``[batch, seq, seq]`` (query, key); the decoder also accepts
``[batch, 1, seq, seq]``. Every query row keeps at least one ``True`` (its own position), so
``scaled_dot_product_attention`` never normalises an empty row into NaN.
"""

import torch


def causal_mask(seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Lower-triangular mask: query ``i`` sees keys ``0..i``.

    Args:
        seq_len: sequence length.
        device: where to build the mask.

    Returns:
        Bool tensor ``[seq_len, seq_len]``; broadcast it or add a batch dim before use.
    """
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def padding_mask(valid: torch.Tensor) -> torch.Tensor:
    """Causal mask that also hides padding keys.

    Args:
        valid: bool ``[batch, seq]``, True on real tokens (left or right padding both work).

    Returns:
        Bool ``[batch, seq, seq]``: ``causal & valid[key]``, with the diagonal kept so padding
        queries (whose outputs are ignored) stay finite.
    """
    if valid.dtype != torch.bool or valid.dim() != 2:
        raise ValueError(
            f"valid must be a bool [batch, seq] tensor, got {valid.dtype} {valid.shape}"
        )
    seq_len = valid.shape[1]
    causal = causal_mask(seq_len, valid.device)
    eye = torch.eye(seq_len, dtype=torch.bool, device=valid.device)
    return (causal & valid[:, None, :]) | eye


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask for packed sequences.

    A query attends to earlier (or same) positions of its own document only, so packing
    documents into one row gives the same outputs as running them separately, provided the
    rotary positions restart at each document (pass them as ``input_pos``).

    Args:
        document_ids: integer ``[batch, seq]``, one id per token (padding can get its own id).

    Returns:
        Bool ``[batch, seq, seq]``.
    """
    if document_ids.dim() != 2:
        raise ValueError(
            f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}"
        )
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    return same_document & causal_mask(document_ids.shape[1], document_ids.device)


def positions_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Rotary positions that restart at 0 at every document boundary.

    Args:
        document_ids: integer ``[batch, seq]``; a document is a run of equal ids.

    Returns:
        Long ``[batch, seq]``, e.g. ids ``[0, 0, 0, 1, 1]`` give ``[0, 1, 2, 0, 1]``.
    """
    batch, seq_len = document_ids.shape
    index = torch.arange(seq_len, device=document_ids.device).expand(batch, seq_len)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # The start index of each token's run: a running max over the indices where runs begin.
    run_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - run_start
