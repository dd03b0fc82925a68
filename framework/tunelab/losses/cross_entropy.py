"""Memory-lean cross-entropy for SFT that returns a sum and a token count.

The recipe normalises once, globally:

    loss = sum over ranks and micro-batches of token losses / total number of target tokens

so every target token weighs the same whatever the padding, the split into micro-batches
or the world size. A per-micro-batch mean would instead give the tokens of a short
micro-batch more weight than those of a long one, and the result would change with the
number of ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from tunelab.errors import ConfigError
from tunelab.losses._token_logps import OutputLayer, hidden_target_logps, target_logps

__all__ = ["CrossEntropyLoss", "token_count"]


def token_count(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Number of target tokens in a batch, as counted by :class:`CrossEntropyLoss`.

    Labels are aligned with the tokens, so the first label of each row is never a target
    (no token predicts it). Recipes call this on every micro-batch before the forward
    passes to know the global token count the loss is divided by.

    Args:
        labels: ``[batch, seq]`` integer labels aligned with the tokens.
        ignore_index: label value that marks a position as not a target.

    Returns:
        A 0-dim int64 tensor on ``labels.device``.
    """
    return (labels[:, 1:] != ignore_index).sum()


class CrossEntropyLoss(nn.Module):
    """Summed next-token cross-entropy, upcast to fp32 one sequence chunk at a time.

    ``logits[:, :-1]`` are scored against ``labels[:, 1:]``: labels are aligned with the
    tokens and the shift happens here. The fp32 upcast of the logits is done per chunk of
    the sequence in the forward and recomputed per chunk in the backward, so the extra
    memory is one fp32 chunk instead of a full fp32 copy of ``[batch, seq, vocab]``.

    Args:
        num_chunks: number of chunks for the fp32 upcast (more = less memory), or None
            (the default): chunks of at most 2**24 logits (64 MiB in fp32), large enough to
            be efficient matrix products, one chunk for a small vocabulary and batch.
        ignore_index: label value that marks a position as not a target.

    Raises:
        ConfigError: if ``num_chunks`` is not a positive integer.

    Example:
        >>> loss_sum, num_tokens = loss_fn(logits, labels)
        >>> (loss_sum / global_num_tokens).backward()
    """

    def __init__(self, num_chunks: int | None = None, ignore_index: int = -100) -> None:
        super().__init__()
        if num_chunks is not None and (
            not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1
        ):
            raise ConfigError(
                f"loss.num_chunks must be a positive integer or null, got {num_chunks!r}"
            )
        self.num_chunks = num_chunks
        self.ignore_index = ignore_index

    def forward(
        self, logits: torch.Tensor, labels: torch.Tensor, output: OutputLayer | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum the cross-entropy over target tokens.

        Args:
            logits: ``[batch, seq, vocab]`` in any float dtype; with ``output``, the final
                hidden states ``[batch, seq, dim]`` instead, or those of the scored positions
                only (``[rows, dim]``, ``tunelab.losses.scored_rows``).
            labels: ``[batch, seq]`` integer labels aligned with the tokens.
            output: The model's output layer, applied here chunk by chunk, so the logits
                never exist whole (see :class:`~tunelab.losses.OutputLayer`).

        Returns:
            ``(loss_sum, num_tokens)``: a 0-dim fp32 tensor (differentiable) and a 0-dim
            int64 tensor. A batch without target tokens gives a 0 sum that still
            back-propagates (zeros), so every rank takes part in the gradient reduction.

        Raises:
            ValueError: if the shapes do not line up.
        """
        if output is not None:
            logps, mask, _ = hidden_target_logps(
                logits, output, labels, self.ignore_index, self.num_chunks, with_logit_sums=False
            )
        else:
            logps, mask = target_logps(logits, labels, self.ignore_index, self.num_chunks)
        return -logps.sum(), mask.sum()

    def extra_repr(self) -> str:
        """The settings shown by ``print(module)``."""
        return f"num_chunks={self.num_chunks}, ignore_index={self.ignore_index}"
