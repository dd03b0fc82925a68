"""The pieces of the rollout engine's decode loop: shared prompts, the decode step, the batch.

- :func:`distinct_prompts`: the prompts a batch holds once each, and which one each row is (a
  GRPO step repeats each prompt ``num_generations`` times: it is prefilled once).
- :class:`DecodeStep`: one token for every row of the batch, eager or ``torch.compile``d
  (compiled once per shape bucket; a failed compile falls back to eager with one line).
- :class:`DecodeBatch`: the rows still decoding; finished rows leave it once they are at least
  half of it, so a forward costs what the live rows cost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from tunelab.training.shared_prompts import distinct_prompts

__all__ = [
    "DecodeBatch",
    "DecodeStep",
    "bucket_length",
    "distinct_prompts",
    "forwards_communicate",
]

logger = logging.getLogger(__name__)

CACHE_LENGTH_BUCKET = 64
"""A compiled decode step's cache length is rounded up to a multiple of this (one compile per
bucket rather than one per longest prompt)."""


def bucket_length(length: int, compiled: bool) -> int:
    """The KV cache length for ``length`` slots: exact eager, rounded up to a bucket compiled."""
    if not compiled:
        return length
    return -(-length // CACHE_LENGTH_BUCKET) * CACHE_LENGTH_BUCKET


def forwards_communicate(model: nn.Module) -> bool:
    """Whether a forward of ``model`` as it stands runs collectives, so ranks must step together.

    A parameter that is still a ``DTensor`` is gathered (FSDP2 shards not held), split over
    ranks (tensor parallelism) or routed to (expert parallelism) inside the forward. Once every
    parameter is a plain tensor (one process, or FSDP2 groups held gathered), a forward is
    local and each rank may run as many as its own rows need.
    """
    return any(type(param).__name__ == "DTensor" for param in model.parameters())


def _decode(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # One new token per row against the KV cache: the next-token logits [rows, vocab].
    hidden = model(tokens, input_pos=positions, return_hidden=True)
    return model.output(hidden[:, -1])


class DecodeStep:
    """The decode forward, ``(tokens [rows, 1], positions [rows, 1]) -> logits [rows, vocab]``.

    With ``compile`` it runs ``torch.compile(_decode, dynamic=False)``: inductor on CPU, and
    on CUDA ``mode="reduce-overhead"`` (CUDA graphs). Shapes are static (the cache length is
    bucketed by :func:`bucket_length`, the batch by :meth:`DecodeBatch.bucket`), so each
    bucket compiles once and later calls reuse it. A compile that fails (or a model it does
    not take: FSDP2-sharded weights) falls back to eager with one logged line.

    Args:
        model: The ``TransformerDecoder`` with its caches set up.
        compile: Compile the step.
    """

    _compiled: dict[str, Callable[..., torch.Tensor]] = {}

    def __init__(self, model: nn.Module, compile: bool) -> None:
        self.model = model
        self.compiled = compile and self._compilable()

    def _compilable(self) -> bool:
        sharded = forwards_communicate(self.model)
        if sharded:
            logger.warning(
                "rollout.compile: the decode step is not compiled for an FSDP2-sharded model; "
                "decoding eagerly"
            )
        return not sharded

    def _compiled_decode(self, device: torch.device) -> Callable[..., torch.Tensor]:
        key = device.type
        if key not in self._compiled:
            mode = "reduce-overhead" if key == "cuda" else None
            # Each (batch, cache length) bucket is one compiled graph: allow a few dozen.
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, 64)
            self._compiled[key] = torch.compile(_decode, dynamic=False, mode=mode)
        return self._compiled[key]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits of the next token of each row (writes the rows' keys/values in the cache)."""
        if self.compiled:
            try:
                return self._compiled_decode(tokens.device)(self.model, tokens, positions).clone()
            except Exception as error:  # noqa: BLE001 - any compile failure falls back
                first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
                logger.warning(
                    "rollout.compile: compiling the decode step failed (%s: %s); decoding eagerly",
                    type(error).__name__,
                    first_line[:200],
                )
                self.compiled = False
        return _decode(self.model, tokens, positions)


class DecodeBatch:
    """The rows of a decode loop, and which of them are done.

    Slot ``i`` of the batch is row ``rows[i]`` of the call. Once the finished rows are at least
    half of the batch, :meth:`compact` keeps the live ones (and the caches' rows with them):
    every row's values are copied bit for bit and a row's computation does not depend on its
    neighbours, so the tokens are unchanged.

    Args:
        positions: long ``[rows]``: each row's first generated position (its prompt length).
        generators: One per row.
        compiled: Batch sizes bucket to powers of two (fewer compiled shapes).
    """

    def __init__(
        self, positions: torch.Tensor, generators: list[torch.Generator], compiled: bool
    ) -> None:
        self.rows = torch.arange(len(generators))
        self.positions = positions
        self.generators = generators
        self.done = torch.zeros(len(generators), dtype=torch.bool)
        self.compiled = compiled

    def bucket(self, live: int) -> int:
        """The batch size that holds ``live`` rows (at least 1: every rank keeps stepping)."""
        live = max(live, 1)
        return 1 << (live - 1).bit_length() if self.compiled else live

    def compact(self, model: nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Drop finished rows once they are half the batch; returns ``tensors``' kept rows.

        Args:
            model: Its caches lose the same rows.
            tensors: Per-slot tensors (on any device) to cut alike.
        """
        live = int((~self.done).sum())
        size = self.bucket(live)
        if live * 2 > len(self.rows) or size >= len(self.rows):
            return tensors
        # The live slots first, then finished ones as filler up to the bucket's size.
        keep = torch.cat([(~self.done).nonzero()[:, 0], self.done.nonzero()[:, 0]])[:size]
        self.rows, self.done = self.rows[keep], self.done[keep]
        self.positions = self.positions[keep.to(self.positions.device)]
        self.generators = [self.generators[i] for i in keep.tolist()]
        for layer in model.layers:
            layer.self_attn.kv_cache.select_rows(keep.to(layer.self_attn.kv_cache.k_cache.device))
        return tuple(t[keep.to(t.device)] for t in tensors)
