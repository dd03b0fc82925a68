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

:func:`hidden_target_logps` goes one step further: it takes the final hidden states and the
model's :class:`OutputLayer` and computes the logits themselves chunk by chunk, so the
``[batch, seq, vocab]`` tensor never exists whole, in the forward or in the backward.

Gradient used in the backward, for target ``y`` at one position with logits ``z``:
``d log softmax(z)_y / dz = onehot(y) - softmax(z)``.

Under tensor parallelism (``OutputLayer.vocab_group``) each rank computes the logits of its
part of the vocabulary only; the log-softmax needs the whole row's ``max`` and ``sum exp``,
two all-reduces of one number per position, and the target's logit comes from the rank that
holds it (a third): ``log p_y = z_y - (m + log sum_ranks sum_v exp(z_v - m))``. The
``[tokens, vocab]`` logits are never gathered (Megatron-LM's vocabulary-parallel
cross-entropy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

# Logits per piece when no number of pieces is given: 2**24 values (64 MiB in fp32). Pieces
# this large are efficient matrix products (eight pieces of 128 rows at vocabulary 8192 ran
# 10% slower than one on one thread, 30% on two), and a 128k vocabulary still comes in pieces
# of ~130 positions (a 4k-token row: ~32 pieces).
CHUNK_LOGITS = 2**24


def chunk_count(num_chunks: int | None, rows: int, values_per_row: int) -> int:
    """Pieces to split ``rows`` positions into (at least 1, at most one per position).

    Args:
        num_chunks: The pieces asked for, or None: as many as keep each piece's logits
            within ``CHUNK_LOGITS`` values.
        rows: Positions (or sequence steps) to split.
        values_per_row: Logits per position (the vocabulary, times the batch when a
            sequence step spans every row).

    Returns:
        The number of pieces.
    """
    if num_chunks is None:
        num_chunks = -(-rows * values_per_row // CHUNK_LOGITS)
    return max(1, min(num_chunks, rows))


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
        num_chunks: int | None,
    ) -> torch.Tensor:
        # Shift inside the function, so the backward can fill a full-size gradient directly
        # instead of autograd padding a sliced one (which would allocate the logits twice).
        targets = labels[:, 1:]
        mask = targets != ignore_index
        safe_targets = targets.masked_fill(~mask, 0)
        shifted = logits[:, :-1]
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(targets.shape, dtype=dtype, device=logits.device)
        num_chunks = chunk_count(num_chunks, shifted.shape[1], shifted.shape[0] * shifted.shape[2])
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


def _check_shapes(values: torch.Tensor, labels: torch.Tensor, name: str, last: str) -> None:
    if values.dim() != 3 or labels.shape != values.shape[:2]:
        raise ValueError(
            f"expected {name} [batch, seq, {last}] and labels [batch, seq], got {name} "
            f"{tuple(values.shape)} and labels {tuple(labels.shape)}"
        )


def target_logps(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, num_chunks: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the shifted labels, upcast chunk by chunk.

    Args:
        logits: ``[batch, seq, vocab]`` in any float dtype.
        labels: ``[batch, seq]`` aligned with the tokens (``labels[:, i]`` belongs to token
            ``i``); ``logits[:, i]`` is scored against ``labels[:, i + 1]``.
        ignore_index: label value that marks a position as not a target.
        num_chunks: number of pieces the sequence is split into for the fp32 upcast (None:
            pieces of at most ``CHUNK_LOGITS`` logits).

    Returns:
        ``(logps, mask)``: ``logps`` ``[batch, seq - 1]`` in fp32 (or wider), 0 where ignored;
        ``mask`` ``[batch, seq - 1]`` bool, True at target positions.

    Raises:
        ValueError: if the shapes do not line up.
    """
    _check_shapes(logits, labels, "logits", "vocab")
    if labels.shape[1] < 2:
        # One token predicts nothing; keep the graph so every rank can still run backward.
        empty = logits[:, :0, 0].to(_compute_dtype(logits.dtype))
        return empty, labels[:, :0] != ignore_index
    logps = _TargetLogProbs.apply(logits, labels, ignore_index, num_chunks)
    return logps, labels[:, 1:] != ignore_index


@dataclass(frozen=True)
class OutputLayer:
    """A model's output layer, which a loss applies itself one sequence chunk at a time.

    Given one to :class:`~tunelab.losses.CrossEntropyLoss` or
    :func:`~tunelab.losses.sequence_logps` together with the final (normed) hidden states
    instead of the logits, the ``[batch, seq, vocab]`` logits never exist whole, neither in
    the forward nor in the backward: peak extra memory is one chunk's logits.

    Attributes:
        forward: Hidden states ``[..., dim]`` to logits ``[..., vocab]``, applied to each
            position independently (``lm_head``, then any final-logit soft-capping).
        trainable: Whether the layer has parameters that train (full fine-tuning, an
            adapter on ``lm_head``). Frozen: each chunk's gradient with respect to its hidden
            states is computed in the forward, as the logits are at hand (no recomputation).
            Trainable: each chunk's logits are recomputed in the backward, which also
            accumulates the layer's own gradients (one more ``lm_head`` forward).
        vocab_size: Size of the whole vocabulary.
        vocab_group: Tensor parallelism: the ranks that split the vocabulary in equal
            consecutive parts, rank ``r`` of the group holding part ``r``; ``forward`` then
            returns this rank's part of the logits. None: ``forward`` returns every logit.
    """

    forward: Callable[[torch.Tensor], torch.Tensor]
    trainable: bool
    vocab_size: int
    vocab_group: dist.ProcessGroup | None = None


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp) -> torch.Tensor:
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _sharded_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs of this rank's vocabulary part, and of the targets, from local logits.

    Returns:
        ``(log_probs, target_logps, local_targets, owned)``: ``log_probs`` ``[tokens,
        vocab / N]`` in ``dtype``; the targets' log-probs ``[tokens]`` (the same on every
        rank); each target's index in this rank's part (0 where another rank holds it) and
        whether this rank holds it.
    """
    part = logits.shape[-1]
    start = dist.get_rank(group) * part
    z = logits.to(dtype)
    row_max = _all_reduce(z.detach().amax(dim=-1), group, dist.ReduceOp.MAX)
    shifted = z - row_max.unsqueeze(-1)
    sum_exp = _all_reduce(shifted.exp().sum(dim=-1), group, dist.ReduceOp.SUM)
    # (z - max) - log(sum): log_softmax's order; z - (max + log(sum)) rounds at max's scale.
    log_probs = shifted - sum_exp.log().unsqueeze(-1)
    owned = (targets >= start) & (targets < start + part)
    local_targets = (targets - start).masked_fill(~owned, 0)
    picked = log_probs.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0)
    return log_probs, _all_reduce(picked, group, dist.ReduceOp.SUM), local_targets, owned


class _ShardedTargetLogProbs(torch.autograd.Function):
    """Target log-probs from this rank's part of the logits (``_sharded_log_probs``).

    Every rank of the group receives the same gradient (the loss after the all-reduces is the
    same everywhere) and computes its own part's: ``w * (onehot(y) - softmax(z))`` on its
    columns, the one-hot only on the rank holding ``y``.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: dist.ProcessGroup,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        log_probs, target_logps, local_targets, owned = _sharded_log_probs(
            logits, targets, group, dtype
        )
        ctx.save_for_backward(log_probs, local_targets, owned)
        ctx.logits_dtype = logits.dtype
        return target_logps

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        log_probs, local_targets, owned = ctx.saved_tensors
        weights = grad_out.to(log_probs.dtype)
        grad = log_probs.exp_().mul_(-weights.unsqueeze(-1))
        grad.scatter_add_(-1, local_targets.unsqueeze(-1), (weights * owned).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def _chunk_logps(
    output: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    dtype: torch.dtype,
    vocab_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # One chunk: its logits, the targets' log-probs (upcast) and the logits' vocabulary sums.
    logits = output(hidden)
    with torch.no_grad():
        logit_sums = logits.sum(dim=-1, dtype=torch.float32)
    if vocab_group is not None:
        logit_sums = _all_reduce(logit_sums, vocab_group, dist.ReduceOp.SUM)
        return _ShardedTargetLogProbs.apply(logits, targets, vocab_group, dtype), logit_sums
    logps = torch.log_softmax(logits, dim=-1, dtype=dtype).gather(-1, targets.unsqueeze(-1))
    return logps.squeeze(-1), logit_sums


class _FrozenOutputLogProbs(torch.autograd.Function):
    """Target log-probs of ``[tokens, dim]`` hidden rows through a frozen output layer.

    Row ``t``'s log-prob depends on ``h_t`` only, so its gradient ``d logp_t / d h_t`` is
    computed in the forward, while the chunk's logits are at hand (``onehot - softmax``
    through the layer's backward), and kept: ``[tokens, dim]``, small next to the logits. The
    backward scales it by the incoming per-row weights: ``dL/dh_t = w_t * d logp_t / d h_t``.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        output: Callable[[torch.Tensor], torch.Tensor],
        num_chunks: int,
        with_logit_sums: bool,
        vocab_group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(hidden.dtype)
        logps, logit_sums, grads = [], [], []
        for hidden_chunk, target_chunk in zip(
            hidden.tensor_split(num_chunks), targets.tensor_split(num_chunks)
        ):
            with torch.enable_grad():
                hidden_chunk = hidden_chunk.detach().requires_grad_()
                logits = output(hidden_chunk)
            if vocab_group is None:
                index = target_chunk.unsqueeze(-1)
                log_probs = torch.log_softmax(logits.detach(), dim=-1, dtype=dtype)
                logps.append(log_probs.gather(-1, index).squeeze(-1))
                minus_one = torch.full_like(index, -1, dtype=dtype)
            else:
                # This rank's part of the vocabulary: the one-hot only where it holds y.
                log_probs, target_logps, local, owned = _sharded_log_probs(
                    logits.detach(), target_chunk, vocab_group, dtype
                )
                logps.append(target_logps)
                index, minus_one = local.unsqueeze(-1), -owned.to(dtype).unsqueeze(-1)
            if with_logit_sums:
                sums = logits.detach().sum(dim=-1, dtype=torch.float32)
                if vocab_group is not None:
                    sums = _all_reduce(sums, vocab_group, dist.ReduceOp.SUM)
                logit_sums.append(sums)
            # d logp_y / d logits = onehot(y) - softmax. The softmax minus the one-hot goes
            # back through the layer and the (small) result is negated: one pass over the
            # [tokens, vocab] chunk fewer than negating the chunk, and bit-identical. Under
            # tensor parallelism the result is this rank's part of the hidden states'
            # gradient, summed over the ranks by the model (``tensor_parallel``).
            minus_grad = log_probs.exp_().scatter_add_(-1, index, minus_one)
            (grad,) = torch.autograd.grad(logits, hidden_chunk, minus_grad.to(logits.dtype))
            grads.append(grad.neg_())
        ctx.save_for_backward(torch.cat(grads))
        logit_sums = torch.cat(logit_sums) if with_logit_sums else hidden.new_zeros(0)
        ctx.mark_non_differentiable(logit_sums)
        return torch.cat(logps), logit_sums

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logps: torch.Tensor, _: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None, None]:
        (grad_hidden,) = ctx.saved_tensors
        scaled = grad_hidden * grad_logps.unsqueeze(-1).to(grad_hidden.dtype)
        return scaled, None, None, None, None, None


def scored_rows(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The positions whose next label is scored, as rows of ``[batch * seq]`` (row-major).

    Position ``t`` of a row predicts ``labels[:, t + 1]``: it is scored where that label is
    not ``ignore_index``. These are the only rows a loss reads of the model's final hidden
    states, so a forward given them (``TransformerDecoder.forward(rows=...)``) may compute its
    last layer's output there only, and the losses take such ``[rows, dim]`` states as they
    take ``[batch, seq, dim]`` ones. One device sync (``nonzero``).

    Args:
        labels: ``[batch, seq]`` aligned with the tokens.
        ignore_index: label value that marks a position as not a target.

    Returns:
        long ``[rows]``, ascending.
    """
    return _scored_positions(labels, ignore_index)[2]


def _scored_positions(
    labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scored positions three ways: ``(mask, scored, rows)``.

    ``mask``: ``[batch, seq - 1]``, True where the next label is scored; ``scored``: their
    indices in ``[batch * (seq - 1)]`` (one device sync); ``rows``: :func:`scored_rows`.
    """
    mask = labels[:, 1:] != ignore_index
    scored = mask.reshape(-1).nonzero().squeeze(-1)
    # Each batch row holds one more position than it scores.
    return mask, scored, scored + scored // max(labels.shape[1] - 1, 1)


def scored_states(states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[rows, dim]``: the scored rows of ``[batch, seq, dim]`` states, or states that are them.

    ``rows`` is :func:`scored_rows` of the batch's labels. Gathered into one contiguous
    matrix (a small copy: ``dim``, not ``vocab``, wide), so that each chunk of the output
    layer is one plain matrix product (a strided 3-D chunk runs as a slower bmm).

    Raises:
        ValueError: ``[rows, dim]`` states that are not as many rows as ``rows``.
    """
    if states.dim() == 3:
        return states.reshape(-1, states.shape[-1]).index_select(0, rows)
    if states.dim() != 2 or states.shape[0] != rows.numel():
        raise ValueError(
            f"expected states [batch, seq, dim] or one row per scored position "
            f"[{rows.numel()}, dim], got {tuple(states.shape)}"
        )
    return states


def hidden_target_logps(
    hidden: torch.Tensor,
    output: OutputLayer,
    labels: torch.Tensor,
    ignore_index: int,
    num_chunks: int | None,
    *,
    with_logit_sums: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`target_logps` from the final hidden states, applying the output layer per chunk.

    Args:
        hidden: ``[batch, seq, dim]`` final (normed) hidden states, or those of the scored
            positions only, ``[rows, dim]`` in the order of :func:`scored_rows`.
        output: The model's output layer.
        labels: ``[batch, seq]`` aligned with the tokens.
        ignore_index: label value that marks a position as not a target.
        num_chunks: number of pieces of the scored positions; one piece's logits is the peak
            extra memory (None: pieces of at most ``CHUNK_LOGITS`` logits).
        with_logit_sums: Also sum each position's logits (a pass over every chunk; the
            cross-entropy does not need them).

    Returns:
        ``(logps, mask, logit_sums)``: as :func:`target_logps`, plus the fp32 sum of each
        position's logits over the vocabulary (detached), ``[batch, seq - 1]``, or None
        without ``with_logit_sums``. Ignored positions never go through the output layer:
        their log-prob and logit sum are 0.

    Raises:
        ValueError: if the shapes do not line up.
    """
    if hidden.dim() != 2:
        _check_shapes(hidden, labels, "hidden states", "dim")
    targets = labels[:, 1:]
    mask, scored, rows = _scored_positions(labels, ignore_index)
    safe_targets = targets.masked_fill(~mask, 0)
    dtype = _compute_dtype(hidden.dtype)
    if targets.shape[1] == 0 and hidden.dim() == 3:
        empty = hidden[:, :0, 0].to(dtype) * 0  # keeps the graph, like target_logps
        return empty, mask, empty.detach().float() if with_logit_sums else None
    # Only scored positions go through the output layer (an SFT prompt, a DPO prompt: often
    # half the rows or more need no logits), as one [scored, dim] matrix.
    flat_hidden = scored_states(hidden, rows)
    flat_targets = safe_targets.reshape(-1).index_select(0, scored)
    num_chunks = chunk_count(num_chunks, flat_targets.numel(), output.vocab_size)
    grad_enabled = torch.is_grad_enabled()
    if grad_enabled and hidden.requires_grad and not output.trainable:
        logps, logit_sums = _FrozenOutputLogProbs.apply(
            flat_hidden, flat_targets, output.forward, num_chunks, with_logit_sums,
            output.vocab_group,
        )  # fmt: skip
    else:
        chunks = zip(flat_hidden.tensor_split(num_chunks), flat_targets.tensor_split(num_chunks))
        if grad_enabled and output.trainable:
            # Recompute each chunk's logits in the backward, which also reaches the layer's
            # parameters; only the chunk's inputs are kept meanwhile.
            group = output.vocab_group
            pieces = [
                checkpoint(_chunk_logps, output.forward, h, t, dtype, group, use_reentrant=False)
                for h, t in chunks
            ]
        else:
            with torch.no_grad():
                pieces = [
                    _chunk_logps(output.forward, h, t, dtype, output.vocab_group) for h, t in chunks
                ]
        logps = torch.cat([piece[0] for piece in pieces])
        logit_sums = torch.cat([piece[1] for piece in pieces])
    # Back to [batch, seq - 1], 0 at ignored positions (out of place: autograd flows to the
    # scored rows only).
    logps = logps.new_zeros(mask.numel()).index_copy(0, scored, logps).view(targets.shape)
    if not with_logit_sums:
        return logps, mask, None
    logit_sums = logit_sums.new_zeros(mask.numel()).index_copy(0, scored, logit_sums)
    return logps, mask, logit_sums.view(targets.shape)
