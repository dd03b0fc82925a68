"""A cache key for torchao's ``NF4Tensor`` under ``torch.compile`` (``compile: true``).

torch 2.13's AOT autograd cache names each tensor subclass input of a compiled graph by
``_stable_hash_for_caching()``. torchao's ``NF4Tensor`` has none, so every compiled block with
an NF4 weight printed a ``UserWarning`` ("NF4Tensor does not implement
_stable_hash_for_caching"), and for the stacked NF4 experts of an MoE model torch's fallback,
which pickles the subclass's inner values, failed with a 30-line "Failed to pickle cache key"
traceback on every process (the graph then compiled uncached).

:func:`hash_nf4_for_compile_caches` gives the class that method. The key is what the compiled
code depends on: the weight's shape, strides, dtype, device and its quantization layout (block
sizes, number of blocks) with the shapes, strides and dtypes of its packed tensors, never their
values (weights are the graph's inputs, not constants), as torch's fallback does.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def _describe(value: Any) -> tuple[Any, ...]:
    """What a compiled graph depends on of one packed tensor (or a plain value)."""
    if isinstance(value, torch.Tensor):
        return (
            type(value).__qualname__,
            tuple(value.shape),
            tuple(value.stride()),
            str(value.dtype),
            value.device.type,
        )
    return (type(value).__qualname__, repr(value))


def _stable_hash_for_caching(self: torch.Tensor) -> str:
    """The NF4 weight's layout, hashed: equal for weights that compile to the same code."""
    inner_names, context = self.__tensor_flatten__()  # type: ignore[attr-defined]
    layout = {key: value for key, value in context.items() if key != "tensor_meta"}
    key = (
        type(self).__qualname__,
        tuple(self.shape),
        tuple(self.stride()),
        self.storage_offset(),
        str(self.dtype),
        self.device.type,
        self.requires_grad,
        sorted((name, repr(value)) for name, value in layout.items()),
        [(name, _describe(getattr(self, name))) for name in inner_names],
    )
    return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()


def hash_nf4_for_compile_caches(nf4_tensor: type) -> None:
    """Give ``nf4_tensor`` a ``_stable_hash_for_caching`` unless it has one (idempotent).

    Args:
        nf4_tensor: torchao's ``NF4Tensor`` class (patched in place; a torchao that defines
            the method keeps its own).
    """
    if not hasattr(nf4_tensor, "_stable_hash_for_caching"):
        nf4_tensor._stable_hash_for_caching = _stable_hash_for_caching  # type: ignore[attr-defined]
