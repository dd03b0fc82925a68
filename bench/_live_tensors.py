"""Peak bytes of live tensors during a computation, counted op by op (no allocator needed).

A ``TorchDispatchMode`` sees every tensor an op creates, autograd's saved tensors and the
backward's included; each storage counts from its creation until it is freed (a weakref
finalizer). The peak is exact for what torch allocates (not Python objects, not the allocator's
cache), the same on CPU and GPU: the loss memory figures of ``bench_distill.py`` and
``tests/unit/test_losses_distillation.py`` use it.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes() as tracker: ...``, then ``tracker.peak`` (bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self._seen or nbytes == 0:
            return
        self._seen.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple | list) else (out,):
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out
