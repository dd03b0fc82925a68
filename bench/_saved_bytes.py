"""What a training step keeps: the bytes autograd saves for the backward, and the state a
process holds (the memory rows of ``bench_parallel.py`` and ``bench_expert_parallel.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of ``tensor``: a DTensor's local tensor, else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(a key naming the storage, its bytes) of the local part of ``tensor``."""
    local = local_part(tensor)
    try:
        storage = local.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:  # a storage-less wrapper (NF4, ...): count its elements
        return id(local), local.numel() * local.element_size()


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The keys of the storages holding ``tensors`` (their local parts)."""
    return {_storage(tensor)[0] for tensor in tensors}


class SavedForBackward:
    """Bytes autograd saves for the backward inside a ``with`` block.

    Each storage counts once, a DTensor by its local part; a storage whose key is in
    ``exclude()`` when the tensor is saved (the parameters) does not count.
    """

    def __init__(self, exclude: Callable[[], set[int]]) -> None:
        self._exclude = exclude
        self._sizes: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def __enter__(self) -> SavedForBackward:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._hooks.__exit__(*exc_info)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key, size = _storage(tensor)
        if key not in self._exclude():
            self._sizes[key] = size
        return tensor

    @property
    def bytes(self) -> int:
        """The bytes saved so far."""
        return sum(self._sizes.values())


def state_bytes(model: torch.nn.Module) -> int:
    """Parameters, gradients and AdamW's two moments this process holds (fp32)."""
    return sum(local_part(param).numel() for param in model.parameters()) * 4 * 4
