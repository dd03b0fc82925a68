"""Per-token target log-probabilities, computed chunk by chunk along the sequence.

Both cross-entropy (SFT) and sequence log-probs (DPO family) need
``log p(labels[:, t+1] | tokens[:, :t+1])`` for every target position. The naive form
``log_softmax(logits.float())`` holds an fp32 copy of the whole ``[batch, seq, vocab]``
tensor in the forward *and* keeps it alive for the backward. With a 128k vocabulary and 4k
tokens that is 2 GiB per sequence on top of the logits themselves.

``_TargetLogProbs`` keeps only the logits (which the model already produced) and the
labels. The forward upcasts one sequence chunk at a time; the backward recomputes the
softmax of each chunk in fp32 and writes its gradient straight into the gradient buffer,
in the logits' dtype. The peak extra memory is one fp32 chunk, ``1 / num_chunks`` of the
full upcast.

Gradient used in the backward, for target ``y`` at one position with logits ``z``:
``d log softmax(z)_y / dz = onehot(y) - softmax(z)``.
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # At least fp32; float64 stays float64 so gradcheck can run on this function.
    return torch.promote_types(dtype, torch.float32)


class _TargetLogProbs(torch.autograd.Function):
    """Shifted per-token target log-probs: ``out[:, t] = log softmax(logits[:, t])[labels[:, t+1]]``."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        num_chunks: int,
    ) -> torch.Tensor:
        # Shift inside the function, so the backward can fill a full-size gradient directly
        # instead of autograd padding a sliced one (which would allocate the logits twice).
        targets = labels[:, 1:]
        mask = targets != ignore_index
        safe_targets = targets.masked_fill(~mask, 0)
        shifted = logits[:, :-1]
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(targets.shape, dtype=dtype, device=logits.device)
        num_chunks = max(1, min(num_chunks, shifted.shape[1]))
        for logit_chunk, target_chunk, out_chunk in zip(
            shifted.tensor_split(num_chunks, dim=1),
            safe_targets.tensor_split(num_chunks, dim=1),
            out.tensor_split(num_chunks, dim=1),
        ):
            log_probs = torch.log_softmax(logit_chunk, dim=-1, dtype=dtype)
            out_chunk.copy_(log_probs.gather(-1, target_chunk.unsqueeze(-1)).squeeze(-1))
        out.masked_fill_(~mask, 0.0)
        ctx.save_for_backward(logits, safe_targets, mask)
        ctx.num_chunks = num_chunks
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        logits, safe_targets, mask = ctx.saved_tensors
        dtype = _compute_dtype(logits.dtype)
        # Ignored positions produced a constant 0, so their gradient is 0.
        weights = grad_out.to(dtype) * mask
        grad_logits = torch.empty_like(logits)
        grad_logits[:, -1].zero_()  # the last position predicts nothing
        for logit_chunk, target_chunk, weight_chunk, grad_chunk in zip(
            logits[:, :-1].tensor_split(ctx.num_chunks, dim=1),
            safe_targets.tensor_split(ctx.num_chunks, dim=1),
            weights.tensor_split(ctx.num_chunks, dim=1),
            grad_logits[:, :-1].tensor_split(ctx.num_chunks, dim=1),
        ):
            grad = torch.softmax(logit_chunk, dim=-1, dtype=dtype).neg_()
            grad.scatter_add_(
                -1, target_chunk.unsqueeze(-1), grad.new_ones(target_chunk.shape).unsqueeze(-1)
            )
            grad_chunk.copy_(grad.mul_(weight_chunk.unsqueeze(-1)))
        return grad_logits, None, None, None


def target_logps(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, num_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the shifted labels, upcast chunk by chunk.

    Args:
        logits: ``[batch, seq, vocab]`` in any float dtype.
        labels: ``[batch, seq]`` aligned with the tokens (``labels[:, i]`` belongs to token
            ``i``); ``logits[:, i]`` is scored against ``labels[:, i + 1]``.
        ignore_index: label value that marks a position as not a target.
        num_chunks: number of pieces the sequence is split into for the fp32 upcast.

    Returns:
        ``(logps, mask)``: ``logps`` ``[batch, seq - 1]`` in fp32 (or wider), 0 where ignored;
        ``mask`` ``[batch, seq - 1]`` bool, True at target positions.

    Raises:
        ValueError: if the shapes do not line up.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [batch, seq, vocab] and labels [batch, seq], got logits "
            f"{tuple(logits.shape)} and labels {tuple(labels.shape)}"
        )
    if labels.shape[1] < 2:
        # One token predicts nothing; keep the graph so every rank can still run backward.
        empty = logits[:, :0, 0].to(_compute_dtype(logits.dtype))
        return empty, labels[:, :0] != ignore_index
    logps = _TargetLogProbs.apply(logits, labels, ignore_index, num_chunks)
    return logps, labels[:, 1:] != ignore_index
