"""Log-probabilities of the completion: per sequence (the DPO family) and per token (RL)."""

from __future__ import annotations

import torch

from tunelab.losses._token_logps import (
    OutputLayer,
    chunk_count,
    hidden_target_logps,
    target_logps,
)

__all__ = ["sequence_logps", "token_logps"]


def sequence_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    *,
    num_chunks: int | None = None,
    output: OutputLayer | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed log-probability of each row's completion tokens.

    ``log pi(y | x) = sum_t log p(labels[:, t+1] | tokens[:, :t+1])`` over the positions
    whose label is not ``ignore_index`` (the prompt and the padding are masked by the data
    pipeline). Labels are aligned with the tokens; the shift happens here. The fp32 upcast
    is done chunk by chunk along the sequence (see :class:`CrossEntropyLoss`).

    Args:
        logits: ``[batch, seq, vocab]`` in any float dtype; with ``output``, the final
            hidden states ``[batch, seq, dim]`` instead, or those of the scored positions
            only (``[rows, dim]``, ``tunelab.losses.scored_rows``).
        labels: ``[batch, seq]`` integer labels aligned with the tokens.
        ignore_index: label value that marks a position as not a completion token.
        num_chunks: number of chunks for the fp32 upcast (None: chunks of at most
            ``CHUNK_LOGITS`` logits, see :class:`CrossEntropyLoss`).
        output: The model's output layer, applied here chunk by chunk, so the logits never
            exist whole (see :class:`~tunelab.losses.OutputLayer`).

    Returns:
        ``(sum_logps, num_tokens, mean_logits)``, each ``[batch]``: the summed completion
        log-probs in fp32 (differentiable), the number of completion tokens (int64), and
        the mean logit over the vocabulary and the completion positions (fp32, detached;
        the ``logits/chosen`` and ``logits/rejected`` metrics). A row without completion
        tokens has sum 0 and mean logit 0.

    Raises:
        ValueError: if the shapes do not line up.
    """
    if output is not None:
        logps, mask, logit_sums = hidden_target_logps(
            logits, output, labels, ignore_index, num_chunks
        )
    else:
        logps, mask = target_logps(logits, labels, ignore_index, num_chunks)
        with torch.no_grad():
            # Per-chunk fp32 sums over the vocabulary; never a full fp32 copy of the logits.
            shifted = logits[:, :-1]
            chunks = chunk_count(num_chunks, shifted.shape[1], shifted.shape[0] * shifted.shape[2])
            logit_sums = torch.cat(
                [
                    chunk.sum(dim=-1, dtype=torch.float32)
                    for chunk in shifted.tensor_split(chunks, 1)
                ],
                dim=1,
            )
    num_tokens = mask.sum(dim=-1)
    with torch.no_grad():
        vocab_size = logits.shape[-1] if output is None else output.vocab_size
        completion_logit_sums = (logit_sums * mask).sum(dim=-1)
        mean_logits = completion_logit_sums / (num_tokens.clamp(min=1) * vocab_size)
    return logps.sum(dim=-1), num_tokens, mean_logits


def token_logps(
    hidden_or_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    output: OutputLayer | None = None,
    ignore_index: int = -100,
    num_chunks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the completion tokens, the output layer applied chunk by chunk.

    With ``output`` (the model's output layer) the input is the final hidden states and only
    positions with a label go through the output layer: the ``[batch, seq, vocab]`` logits
    never exist (see :class:`OutputLayer`).

    Args:
        hidden_or_logits: ``[batch, seq, dim]`` hidden states with ``output`` (or
            ``[rows, dim]`` of the scored positions only), else logits.
        labels: ``[batch, seq]`` aligned with the tokens, ``ignore_index`` where not scored.
        output: The model's output layer, or None when logits are given.
        ignore_index: Label of positions that are not completion tokens.
        num_chunks: Pieces of the fp32 log-softmax (None: by size).

    Returns:
        ``(logps, mask)``, each ``[batch, seq - 1]``: log-probs in fp32 (0 where not scored,
        differentiable) and the bool mask of scored positions.
    """
    if output is None:
        return target_logps(hidden_or_logits, labels, ignore_index, num_chunks)
    logps, mask, _ = hidden_target_logps(
        hidden_or_logits, output, labels, ignore_index, num_chunks, with_logit_sums=False
    )
    return logps, mask
