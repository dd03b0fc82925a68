"""Knowledge-distillation losses: the student matches the teacher's next-token distribution.

Per scored position ``t`` with student logits ``z_s`` and teacher logits ``z_t`` (same
vocabulary), temperature ``T``:

    S = softmax(z_s / T),  P = softmax(z_t / T)          (student, teacher)

and the per-token divergence ``D_t`` is one of (GKD, Agarwal et al. 2024, eq. 1; TRL's
``generalized_jsd_loss``):

- :class:`ForwardKLLoss`: ``KL(P || S) = sum_v P_v (log P_v - log S_v)`` (mass-covering;
  torchtune's KD recipe, Hinton et al. 2015, without the ``T**2`` factor, as TRL);
- :class:`ReverseKLLoss`: ``KL(S || P) = sum_v S_v (log S_v - log P_v)`` (mode-seeking;
  MiniLLM, on-policy distillation);
- :class:`GeneralizedJSDLoss`: ``beta KL(P || M) + (1 - beta) KL(S || M)`` with
  ``M = beta P + (1 - beta) S``; ``beta = 0`` is defined as the forward KL and ``beta = 1`` as
  the reverse KL (the limits of the divergence divided by ``beta (1 - beta)``, as TRL's
  ``GKDTrainer`` special-cases them).

``top_k``: the support is cut to the teacher's ``k`` most likely tokens at that position, and
both distributions are renormalised over those ``k`` tokens (``P`` and ``S`` are the softmax
of the gathered ``k`` logits each) before the divergence: TRL's ``GOLDTrainer``
``generalized_jsd_loss(top_k=...)`` variant. The student's mass outside the teacher's top-k
then neither counts nor gets a gradient.

``nll_weight`` ``w`` mixes the divergence with the student's next-token negative
log-likelihood of the label (at temperature 1, full vocabulary):
``loss_t = (1 - w) D_t + w (-log softmax(z_s)[y_t])``.

Memory: the logits of student and teacher never exist whole. The loss takes the final hidden
states of both models and their output layers (:class:`~tunelab.losses.OutputLayer`), gathers
the scored positions, and computes both models' logits one chunk of positions at a time. The
chunk's computation is checkpointed: the backward recomputes the chunk's logits instead of
keeping them, so the peak extra memory is a few ``[chunk, vocab]`` tensors whatever the
sequence length. The same chunking applies when whole logits are given (no output layers).

Metrics (per-token sums, detached): ``distill`` (``D_t``), ``nll``, ``teacher_kl``
(``KL(teacher || student)`` at temperature 1 over the full vocabulary, whatever the loss) and
``student_entropy`` (at temperature 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tunelab.errors import ConfigError
from tunelab.losses._token_logps import (
    OutputLayer,
    _scored_positions,
    chunk_count,
    scored_states,
)

__all__ = [
    "DistillationLoss",
    "DistillationSums",
    "ForwardKLLoss",
    "GeneralizedJSDLoss",
    "ReverseKLLoss",
    "SupportLogProbs",
]

# Logits per chunk and model when no number of chunks is given: 2**21 (8 MiB in fp32). A chunk
# holds about 16 such tensors at its peak (both models' logits, log-softmaxes, the divergence's
# terms and the metrics'), so the cross-entropy's 2**24 would cost 16 x 64 MiB; measured at
# vocabulary 128k: 1 GiB of live tensors for 1024 tokens, as much as the two logits tensors.
CHUNK_LOGITS = 2**21

# ...but never fewer positions than this per chunk: each chunk's output layers read their whole
# weights, so few rows make memory-bound matmuls. Measured (2 CPUs, vocabulary 32768, hidden
# 768, 880 positions, generalized JSD, forward and backward): 16 rows 15.4 CPU-s, 64 rows 5.9,
# 128 rows 3.6, all at once 3.6. At vocabulary 128k a chunk is then ~64 MiB per tensor.
MIN_CHUNK_ROWS = 128

TeacherRows = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A chunk's teacher: its logits, or a cached top-k ``(index [rows, k], logps [rows, k])``."""

METRIC_NAMES = ("distill", "nll", "teacher_kl", "student_entropy")
"""The per-token sums a :class:`DistillationLoss` returns next to the loss."""


@dataclass(frozen=True)
class DistillationSums:
    """A micro-batch's distillation loss and metrics, summed over its scored tokens.

    Attributes:
        loss_sum: 0-dim, differentiable with respect to the student only.
        num_tokens: 0-dim int64: scored positions.
        metrics: ``distill``, ``nll``, ``teacher_kl``, ``student_entropy``: 0-dim fp64 sums,
            detached.
    """

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    metrics: dict[str, torch.Tensor]


@dataclass(frozen=True)
class SupportLogProbs:
    """Both models' log-probabilities on a divergence's support, and their exponentials.

    Each is ``[rows, support]`` and detached: the whole vocabulary, or the teacher's top-k,
    at the loss temperature.
    """

    student_logps: torch.Tensor
    teacher_logps: torch.Tensor
    student_probs: torch.Tensor
    teacher_probs: torch.Tensor


def _aligned(values: torch.Tensor, labels: torch.Tensor) -> bool:
    # [batch, seq, *] values of [batch, seq] labels.
    return values.dim() == 3 and values.shape[:2] == labels.shape


def _identity(values: torch.Tensor) -> torch.Tensor:
    return values


def _split(
    rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor], num_chunks: int
) -> list[torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]]:
    # Chunks of a teacher's rows: a tensor, or a cached top-k's (index, logps) pair.
    if isinstance(rows, tuple):
        return list(zip(*(part.tensor_split(num_chunks) for part in rows), strict=True))
    return list(rows.tensor_split(num_chunks))


class DistillationLoss(nn.Module):
    """Base of the distillation losses: chunking, temperature, top-k, the NLL mix and metrics.

    A subclass gives :meth:`divergence` of log-probabilities; everything else lives here.

    Args:
        temperature: Divides both models' logits before the softmax of the divergence.
        top_k: Keep only the teacher's ``k`` most likely tokens per position, both
            distributions renormalised over them (None: the whole vocabulary).
        nll_weight: ``w`` in ``(1 - w) D + w NLL`` (0: pure distillation).
        num_chunks: Pieces the scored positions are split into (None: pieces of at most
            ``CHUNK_LOGITS`` (2**21) logits per model, of at least ``MIN_CHUNK_ROWS`` (128)
            positions).
        ignore_index: Label value of a position that is not scored.

    Raises:
        ConfigError: A setting out of range.
    """

    def __init__(
        self,
        temperature: float = 1.0,
        top_k: int | None = None,
        nll_weight: float = 0.0,
        num_chunks: int | None = None,
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        if not (isinstance(temperature, int | float) and math.isfinite(temperature)) or (
            temperature <= 0
        ):
            raise ConfigError(f"loss.temperature must be a finite number > 0, got {temperature!r}")
        if top_k is not None and (
            isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1
        ):
            raise ConfigError(f"loss.top_k must be a positive integer or null, got {top_k!r}")
        if not (isinstance(nll_weight, int | float) and 0 <= nll_weight <= 1):
            raise ConfigError(f"loss.nll_weight must be within [0, 1], got {nll_weight!r}")
        if num_chunks is not None and (
            isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1
        ):
            raise ConfigError(
                f"loss.num_chunks must be a positive integer or null, got {num_chunks!r}"
            )
        self.temperature = float(temperature)
        self.top_k = top_k
        self.nll_weight = float(nll_weight)
        self.num_chunks = num_chunks
        self.ignore_index = ignore_index

    def divergence(self, student_logps: torch.Tensor, teacher_logps: torch.Tensor) -> torch.Tensor:
        """Per-row divergence of two ``[rows, support]`` log-probability tensors.

        Args:
            student_logps: The student's log-probs (temperature and top-k applied).
            teacher_logps: The teacher's, on the same support.

        Returns:
            ``[rows]``.
        """
        raise NotImplementedError

    def teacher_support(
        self, teacher_logits: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The teacher's side of the divergence: its support and log-probs on it.

        Args:
            teacher_logits: ``[rows, vocab]`` (detached; computed in at least fp32).

        Returns:
            ``(index, logps)``: with ``top_k`` below the vocabulary, ``index [rows, k]`` (the
            teacher's ``k`` most likely tokens at the loss temperature) and the teacher's
            log-probs renormalised over them ``[rows, k]``; otherwise ``None`` and the
            log-probs over the whole vocabulary. This is what a precomputed teacher top-k
            cache stores (``tunelab.distill.TeacherTopKCache``).
        """
        scaled = teacher_logits / self.temperature if self.temperature != 1 else teacher_logits
        index = None
        if self.top_k is not None and self.top_k < scaled.shape[-1]:
            index = scaled.topk(self.top_k, dim=-1).indices
            scaled = scaled.gather(-1, index)
        return index, torch.log_softmax(scaled, dim=-1)

    def divergence_with_gradient(
        self, support: SupportLogProbs
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The divergence and its gradient with respect to the student's (scaled) logits.

        A subclass that knows the gradient in closed form gives it here, and the loss then
        runs no autograd over the ``[rows, vocab]`` tensors (about half the passes over them).
        The default, None, makes the loss differentiate :meth:`divergence` with autograd.

        Args:
            support: Both models' log-probs on the support, and their exponentials.

        Returns:
            ``(divergence [rows], d divergence / d logits [rows, support])``, or None.
        """
        return None

    def token_terms(
        self, student_logits: torch.Tensor, teacher_logits: TeacherRows, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token loss and metrics of ``[rows, vocab]`` logits (one chunk).

        Args:
            student_logits: Differentiable.
            teacher_logits: Detached logits, or a cached teacher top-k ``(index [rows, k],
                logps [rows, k])`` as :meth:`teacher_support` gives them.
            targets: ``[rows]`` label of each row (for the NLL).

        Returns:
            ``(loss [rows], metrics [rows, 4])``; the metrics are detached, in the order of
            ``METRIC_NAMES``. With a cached top-k the teacher's whole distribution is unknown:
            ``teacher_kl`` is then KL(teacher || student) over the cached support, both
            renormalised, at the loss temperature.
        """
        if self._has_closed_form_gradient():
            return _ClosedFormTerms.apply(student_logits, teacher_logits, targets, self)
        # A subclass with a divergence only: autograd differentiates the whole chunk.
        dtype = torch.promote_types(student_logits.dtype, torch.float32)
        student = student_logits.to(dtype)
        teacher, index, teacher_support_logps = self._teacher_rows(teacher_logits, dtype)
        student_support_logps = torch.log_softmax(self._student_support(student, index), dim=-1)
        divergence = self.divergence(student_support_logps, teacher_support_logps)
        student_logps = torch.log_softmax(student, dim=-1)
        nll = -student_logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss = (
            divergence
            if self.nll_weight == 0
            else (1 - self.nll_weight) * divergence + self.nll_weight * nll
        )
        with torch.no_grad():
            student_logps = student_logps.detach()
            if teacher is not None:
                teacher_logps = torch.log_softmax(teacher, dim=-1)
                teacher_kl = (teacher_logps.exp() * (teacher_logps - student_logps)).sum(-1)
            else:
                teacher_kl = _kl(teacher_support_logps, student_support_logps.detach())
            entropy = -(student_logps.exp() * student_logps).sum(-1)
            metrics = torch.stack([divergence.detach(), nll.detach(), teacher_kl, entropy], dim=-1)
        return loss, metrics

    def _has_closed_form_gradient(self) -> bool:
        return type(self).divergence_with_gradient is not DistillationLoss.divergence_with_gradient

    def _teacher_rows(
        self, teacher_logits: TeacherRows, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        # (whole teacher logits or None for a cached top-k, support index or None, log-probs on
        # the support).
        if isinstance(teacher_logits, tuple):
            return None, teacher_logits[0], teacher_logits[1].to(dtype)
        teacher = teacher_logits.detach().to(dtype)
        index, logps = self.teacher_support(teacher)
        return teacher, index, logps

    def _student_support(self, student: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        scaled = student / self.temperature if self.temperature != 1 else student
        return scaled.gather(-1, index) if index is not None else scaled

    @torch.no_grad()
    def _closed_form_terms(
        self, student_logits: torch.Tensor, teacher_logits: TeacherRows, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The loss, metrics and d loss / d student logits of each row, each [rows, vocab]
        # quantity computed once: at temperature 1 over the whole vocabulary the divergence's
        # log-probs are also the NLL's, the entropy's and the teacher KL's.
        dtype = torch.promote_types(student_logits.dtype, torch.float32)
        student = student_logits.detach().to(dtype)
        teacher, index, teacher_logps = self._teacher_rows(teacher_logits, dtype)
        student_logps = torch.log_softmax(self._student_support(student, index), dim=-1)
        student_probs, teacher_probs = student_logps.exp(), teacher_logps.exp()
        divergence, support_grad = self.divergence_with_gradient(
            SupportLogProbs(student_logps, teacher_logps, student_probs, teacher_probs)
        )
        if self.temperature != 1:
            support_grad /= self.temperature
        if index is not None:
            grad = torch.zeros_like(student).scatter_(-1, index, support_grad)
        else:
            grad = support_grad
        whole = index is None and self.temperature == 1
        full_logps = student_logps if whole else torch.log_softmax(student, dim=-1)
        full_probs = student_probs if whole else full_logps.exp()
        nll = -full_logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss = divergence
        if self.nll_weight != 0:
            # d NLL / d logits = softmax - one_hot(target).
            loss = (1 - self.nll_weight) * divergence + self.nll_weight * nll
            grad = grad * (1 - self.nll_weight) + full_probs * self.nll_weight
            grad.scatter_add_(
                -1, targets.unsqueeze(-1), torch.full_like(nll, -self.nll_weight).unsqueeze(-1)
            )
        if teacher is None:
            teacher_kl = _kl(teacher_logps, student_logps)
        elif whole:
            teacher_kl = _kl(teacher_logps, full_logps, teacher_probs)
        else:
            full_teacher = torch.log_softmax(teacher, dim=-1)
            teacher_kl = _kl(full_teacher, full_logps)
        entropy = -(full_probs * full_logps).sum(-1)
        metrics = torch.stack([divergence, nll, teacher_kl, entropy], dim=-1)
        return loss, metrics, grad.to(student_logits.dtype)

    def forward(
        self,
        student: torch.Tensor,
        teacher: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        labels: torch.Tensor,
        output: OutputLayer | None = None,
        teacher_output: OutputLayer | None = None,
    ) -> DistillationSums:
        """Sum the per-token loss over the scored positions, chunk by chunk.

        ``student[:, t]`` and ``teacher[:, t]`` predict ``labels[:, t + 1]``; positions whose
        next label is ``ignore_index`` are not scored.

        Args:
            student: The student's logits ``[batch, seq, vocab]``, or with ``output`` its final
                hidden states ``[batch, seq, dim]`` or those of the scored positions only
                (``[rows, dim]``, ``tunelab.losses.scored_rows``).
            teacher: The teacher's logits, or with ``teacher_output`` its hidden states
                ``[batch, seq, teacher_dim]`` or ``[rows, teacher_dim]`` (no gradient flows to
                it); or a precomputed
                teacher top-k of the scored positions in row-major order, ``(index [scored,
                k], logps [scored, k])`` as :meth:`teacher_support_rows` gives them (then
                ``teacher_output`` is None).
            labels: ``[batch, seq]`` aligned with the tokens.
            output: The student's output layer, applied here chunk by chunk.
            teacher_output: The teacher's output layer (needed with ``output`` and live
                teacher states).

        Returns:
            The loss sum, the number of scored tokens and the metric sums.

        Raises:
            ValueError: Shapes that do not line up, or one output layer without the other.
        """
        cached = isinstance(teacher, tuple)
        if not cached and (output is None) != (teacher_output is None):
            raise ValueError("give both output layers (chunked logits) or neither (whole logits)")
        teacher_shape = teacher[1].shape if cached else teacher.shape
        student_fits = _aligned(student, labels) or (output is not None and student.dim() == 2)
        teacher_fits = (
            cached
            or _aligned(teacher, labels)
            or (teacher_output is not None and teacher.dim() == 2)
        )
        if not (student_fits and teacher_fits):
            raise ValueError(
                f"expected student [batch, seq, *], teacher [batch, seq, *] and labels "
                f"[batch, seq], got {tuple(student.shape)}, {tuple(teacher_shape)} and "
                f"{tuple(labels.shape)}"
            )
        student_forward = output.forward if output is not None else _identity
        teacher_forward = teacher_output.forward if teacher_output is not None else _identity
        vocab = output.vocab_size if output is not None else student.shape[-1]
        rows, flat_targets, mask = self._scored_rows(labels)
        student_rows = scored_states(student, rows)
        if cached:
            if teacher[0].shape != teacher_shape or teacher_shape[0] != rows.numel():
                raise ValueError(
                    f"the cached teacher top-k holds {tuple(teacher_shape)} rows for "
                    f"{rows.numel()} scored positions"
                )
            teacher_rows = (teacher[0], teacher[1])
        else:
            teacher_rows = scored_states(teacher.detach(), rows)
        num_chunks = self._chunk_count(flat_targets.numel(), vocab)
        needs_grad = torch.is_grad_enabled() and student.requires_grad
        if needs_grad and output is not None and not output.trainable:
            # A frozen output layer: each row's gradient is computed in the forward, while the
            # chunk's logits are at hand, instead of recomputing them in the backward.
            loss_rows, metric_rows = _FrozenOutputDistillation.apply(
                student_rows, teacher_rows, flat_targets, self, student_forward, teacher_forward,
                num_chunks,
            )  # fmt: skip
            losses, metrics = [loss_rows], [metric_rows]
        else:
            losses, metrics = self._chunks(
                student_forward, teacher_forward, student_rows, teacher_rows, flat_targets,
                num_chunks, needs_grad,
            )  # fmt: skip
        # Keep the graph even without scored tokens, so every rank runs its backward.
        loss_sum = torch.cat(losses).sum() + student_rows.sum() * 0
        totals = (
            torch.cat(metrics).double().sum(0) if metrics else torch.zeros(4, dtype=torch.float64)
        )
        return DistillationSums(
            loss_sum=loss_sum,
            num_tokens=mask.sum(),
            metrics=dict(zip(METRIC_NAMES, totals.unbind(), strict=True)),
        )

    def _chunk_count(self, num_rows: int, vocab: int) -> int:
        # num_chunks, or pieces of at most CHUNK_LOGITS logits per model but of at least
        # MIN_CHUNK_ROWS positions.
        num_rows = max(num_rows, 1)
        if self.num_chunks is not None:
            return chunk_count(self.num_chunks, num_rows, vocab)
        by_logits = -(-num_rows * vocab // CHUNK_LOGITS)
        return chunk_count(min(by_logits, max(1, num_rows // MIN_CHUNK_ROWS)), num_rows, vocab)

    def _scored_rows(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The flat [batch * seq] rows that predict a scored label (row-major), their targets,
        # and the [batch, seq - 1] mask of scored next labels.
        mask, scored, rows = _scored_positions(labels, self.ignore_index)
        return rows, labels[:, 1:].reshape(-1).index_select(0, scored), mask

    @torch.no_grad()
    def teacher_support_rows(
        self,
        teacher: torch.Tensor,
        labels: torch.Tensor,
        teacher_output: OutputLayer | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k at every scored position of a batch: what a cache stores.

        The same rows, chunks and operations as :meth:`forward` with the live teacher, so a
        loss computed from the result equals the live one.

        Args:
            teacher: The teacher's logits, or with ``teacher_output`` its hidden states (of
                every position, or of the scored ones only: ``[rows, teacher_dim]``).
            labels: ``[batch, seq]``.
            teacher_output: The teacher's output layer, applied chunk by chunk.

        Returns:
            ``(index [scored, k] int64, logps [scored, k])`` in row-major order of the scored
            positions.

        Raises:
            ConfigError: Without ``top_k`` (a cache of the whole vocabulary is the logits).
        """
        if self.top_k is None:
            raise ConfigError("loss.top_k: a precomputed teacher top-k needs top_k set")
        rows, _, _ = self._scored_rows(labels)
        teacher_rows = scored_states(teacher, rows)
        vocab = teacher_output.vocab_size if teacher_output is not None else teacher.shape[-1]
        num_chunks = self._chunk_count(rows.numel(), vocab)
        forward = teacher_output.forward if teacher_output is not None else _identity
        indices, logps = [], []
        for chunk in teacher_rows.tensor_split(num_chunks):
            logits = forward(chunk)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            index, chunk_logps = self.teacher_support(logits)
            if index is None:  # top_k covers the whole vocabulary
                index = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
            indices.append(index)
            logps.append(chunk_logps)
        return torch.cat(indices), torch.cat(logps)

    def _chunks(
        self,
        student_forward: Callable[[torch.Tensor], torch.Tensor],
        teacher_forward: Callable[[torch.Tensor], torch.Tensor],
        student_rows: torch.Tensor,
        teacher_rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        targets: torch.Tensor,
        num_chunks: int,
        needs_grad: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # Each chunk's loss and metrics; with a gradient the chunk is checkpointed (its logits
        # are recomputed in the backward rather than kept).
        losses, metrics = [], []
        for student_chunk, teacher_chunk, target_chunk in zip(
            student_rows.tensor_split(num_chunks),
            _split(teacher_rows, num_chunks),
            targets.tensor_split(num_chunks),
        ):
            args = (student_forward, teacher_forward, student_chunk, teacher_chunk, target_chunk)
            if needs_grad:
                loss, chunk_metrics = checkpoint(self._chunk, *args, use_reentrant=False)
            else:
                loss, chunk_metrics = self._chunk(*args)
            losses.append(loss)
            metrics.append(chunk_metrics)
        return losses, metrics

    def _chunk(
        self,
        student_forward: Callable[[torch.Tensor], torch.Tensor],
        teacher_forward: Callable[[torch.Tensor], torch.Tensor],
        student_rows: torch.Tensor,
        teacher_rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        targets: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        student_logits = student_forward(student_rows)
        if isinstance(teacher_rows, tuple):  # a cached top-k: no teacher computation
            return self.token_terms(student_logits, teacher_rows, targets)
        with torch.no_grad():
            teacher_logits = teacher_forward(teacher_rows)
        if teacher_logits.shape[-1] != student_logits.shape[-1]:
            raise ValueError(
                f"teacher vocabulary {teacher_logits.shape[-1]} != student vocabulary "
                f"{student_logits.shape[-1]}"
            )
        return self.token_terms(student_logits, teacher_logits, targets)

    def extra_repr(self) -> str:
        """The settings shown by ``print(module)``."""
        return (
            f"temperature={self.temperature}, top_k={self.top_k}, nll_weight={self.nll_weight}, "
            f"num_chunks={self.num_chunks}"
        )


class _FrozenOutputDistillation(torch.autograd.Function):
    """Per-row distillation losses through a frozen student output layer, gradients in forward.

    Row ``t``'s loss depends on the student's hidden row ``h_t`` only, so
    ``d loss_t / d h_t`` is the gradient of the chunk's summed loss, computed while the chunk's
    logits are at hand and kept (``[rows, dim]``, small next to the logits); the backward
    scales it by the incoming per-row weights. No chunk is computed twice.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        student_rows: torch.Tensor,
        teacher_rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        targets: torch.Tensor,
        loss: DistillationLoss,
        student_forward: Callable[[torch.Tensor], torch.Tensor],
        teacher_forward: Callable[[torch.Tensor], torch.Tensor],
        num_chunks: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        losses, metrics, grads = [], [], []
        for student_chunk, teacher_chunk, target_chunk in zip(
            student_rows.tensor_split(num_chunks),
            _split(teacher_rows, num_chunks),
            targets.tensor_split(num_chunks),
        ):
            with torch.enable_grad():
                hidden = student_chunk.detach().requires_grad_()
                chunk_loss, chunk_metrics = loss._chunk(
                    student_forward, teacher_forward, hidden, teacher_chunk, target_chunk
                )
                (grad,) = torch.autograd.grad(chunk_loss.sum(), hidden)
            losses.append(chunk_loss.detach())
            metrics.append(chunk_metrics)
            grads.append(grad)
        ctx.save_for_backward(torch.cat(grads))
        metric_rows = torch.cat(metrics)
        ctx.mark_non_differentiable(metric_rows)
        return torch.cat(losses), metric_rows

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_losses: torch.Tensor, _: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        (grads,) = ctx.saved_tensors
        return (grads * grad_losses.unsqueeze(-1).to(grads.dtype),) + (None,) * 6


def _kl(
    from_logps: torch.Tensor, to_logps: torch.Tensor, from_probs: torch.Tensor | None = None
) -> torch.Tensor:
    # KL(from || to) per row; a zero-probability term contributes 0 (exp(-inf) * finite).
    probs = from_logps.exp() if from_probs is None else from_probs
    return (probs * (from_logps - to_logps)).nan_to_num(0.0).sum(-1)


class _ClosedFormTerms(torch.autograd.Function):
    """A chunk's per-row loss and metrics, with the gradient the loss gives in closed form.

    The forward computes ``d loss_t / d logits_t`` with the loss (no graph over the
    ``[rows, vocab]`` tensors) and keeps it; the backward scales it by the incoming per-row
    weights. Under the chunks' checkpoint it is recomputed in the backward, as the logits are.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        targets: torch.Tensor,
        loss: DistillationLoss,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, metrics, grad = loss._closed_form_terms(student_logits, teacher_logits, targets)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(metrics)
        return rows, metrics

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_rows: torch.Tensor, _: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        return grad * grad_rows.unsqueeze(-1).to(grad.dtype), None, None, None


def _forward_kl(support: SupportLogProbs) -> tuple[torch.Tensor, torch.Tensor]:
    # KL(P || S) and its gradient with respect to the student's logits: S - P.
    divergence = _kl(support.teacher_logps, support.student_logps, support.teacher_probs)
    return divergence, support.student_probs - support.teacher_probs


def _reverse_kl(support: SupportLogProbs) -> tuple[torch.Tensor, torch.Tensor]:
    # KL(S || P) = D and its gradient with respect to the student's logits: S (s - t - D).
    ratio = support.student_logps - support.teacher_logps
    divergence = (support.student_probs * ratio).nan_to_num(0.0).sum(-1)
    return divergence, ratio.sub_(divergence.unsqueeze(-1)).mul_(support.student_probs)


class ForwardKLLoss(DistillationLoss):
    """Forward KL ``KL(teacher || student)`` per token (mass-covering; classic KD).

    See :class:`DistillationLoss` for the settings.
    """

    def divergence(self, student_logps: torch.Tensor, teacher_logps: torch.Tensor) -> torch.Tensor:
        """``sum_v P_v (log P_v - log S_v)``."""
        return _kl(teacher_logps, student_logps)

    def divergence_with_gradient(
        self, support: SupportLogProbs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward KL and its gradient ``S - P``."""
        return _forward_kl(support)


class ReverseKLLoss(DistillationLoss):
    """Reverse KL ``KL(student || teacher)`` per token (mode-seeking; on-policy distillation).

    See :class:`DistillationLoss` for the settings.
    """

    def divergence(self, student_logps: torch.Tensor, teacher_logps: torch.Tensor) -> torch.Tensor:
        """``sum_v S_v (log S_v - log P_v)``."""
        return _kl(student_logps, teacher_logps)

    def divergence_with_gradient(
        self, support: SupportLogProbs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reverse KL ``D`` and its gradient ``S (log S - log P - D)``."""
        return _reverse_kl(support)


class GeneralizedJSDLoss(DistillationLoss):
    """Generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024, eq. 1).

    ``beta KL(P || M) + (1 - beta) KL(S || M)``, ``M = beta P + (1 - beta) S`` (P teacher, S
    student); ``beta = 0`` is the forward KL and ``beta = 1`` the reverse KL, as in TRL.

    Args:
        beta: The interpolation, within [0, 1].
        **settings: Those of :class:`DistillationLoss`.

    Raises:
        ConfigError: ``beta`` outside [0, 1].
    """

    def __init__(self, beta: float = 0.5, **settings: float | int | None) -> None:
        super().__init__(**settings)
        if not (isinstance(beta, int | float) and 0 <= beta <= 1):
            raise ConfigError(f"loss.beta must be within [0, 1], got {beta!r}")
        self.beta = float(beta)

    def divergence(self, student_logps: torch.Tensor, teacher_logps: torch.Tensor) -> torch.Tensor:
        """The generalized JSD of each row (the KL limits at ``beta`` 0 and 1)."""
        if self.beta == 0:
            return _kl(teacher_logps, student_logps)
        if self.beta == 1:
            return _kl(student_logps, teacher_logps)
        mixture = torch.logaddexp(
            student_logps + math.log1p(-self.beta), teacher_logps + math.log(self.beta)
        )
        return self.beta * _kl(teacher_logps, mixture) + (1 - self.beta) * _kl(
            student_logps, mixture
        )

    def divergence_with_gradient(
        self, support: SupportLogProbs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The generalized JSD and its gradient ``(1 - beta) S (log S - log M - KL(S || M))``.

        With ``M = beta P + (1 - beta) S``, ``d JSD / d S_v = (1 - beta) log(S_v / M_v)`` (the
        ``P / M`` and ``S / M`` terms cancel), and the softmax's Jacobian gives the rest.
        """
        if self.beta == 0:
            return _forward_kl(support)
        if self.beta == 1:
            return _reverse_kl(support)
        mixture = torch.logaddexp(
            support.student_logps + math.log1p(-self.beta),
            support.teacher_logps + math.log(self.beta),
        )
        student_ratio = support.student_logps - mixture
        student_kl = (support.student_probs * student_ratio).nan_to_num(0.0).sum(-1)
        teacher_kl = _kl(support.teacher_logps, mixture, support.teacher_probs)
        divergence = self.beta * teacher_kl + (1 - self.beta) * student_kl
        grad = student_ratio.sub_(student_kl.unsqueeze(-1)).mul_(support.student_probs)
        return divergence, grad.mul_(1 - self.beta)

    def extra_repr(self) -> str:
        """The settings shown by ``print(module)``."""
        return f"beta={self.beta}, " + super().extra_repr()
