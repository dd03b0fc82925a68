"""The private torch APIs tunelab uses, each in one place, for the torch versions it is tested on.

torch has no public API for these yet. Private modules move between releases without notice,
so every use goes through this module: importing it checks the torch version against the range
``pyproject.toml`` declares (``TORCH_SUPPORTED``), and ``tests/unit/test_torch_compat.py`` runs
each function on the installed torch. A new torch release that moves one breaks here, in one
file, with one message.
"""

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.torch_version import TorchVersion

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

TORCH_SUPPORTED = ((2, 13), (3, 0))
"""Oldest tested ``(major, minor)`` and the first major version not supported (pyproject's range)."""


def check_torch_version(version: str) -> None:
    """Refuse a torch outside ``TORCH_SUPPORTED``.

    Args:
        version: A torch version string (``torch.__version__``, e.g. ``"2.13.0+cpu"``).

    Raises:
        ImportError: ``version`` is older than the oldest tested one or a new major version.
    """
    low, high = TORCH_SUPPORTED
    if not low <= TorchVersion(version) < high:
        raise ImportError(
            f"tunelab needs torch>={low[0]}.{low[1]},<{high[0]} (it uses torch internals that "
            f"move between releases); found torch {version}"
        )


check_torch_version(torch.__version__)


def local_shape_and_global_offset(tensor: "DTensor") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return this rank's local shape of ``tensor`` and the global index of its first element.

    Private API: ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``
    (torch's own DTensor and DCP code use it; FSDP2's uneven ``Shard(0)`` splits included).

    Args:
        tensor: A ``DTensor`` with any placements.

    Returns:
        ``(local_shape, global_offset)``, one entry per dimension.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )


def checkpoint_activations(module: nn.Module) -> nn.Module:
    """Recompute ``module``'s activations in backward, keeping its parameter names.

    Private API: ``torch.distributed._composable.checkpoint``. Unlike ``checkpoint_wrapper``
    it adds no ``_checkpoint_wrapped_module.`` name component, so
    checkpoints and adapters keep the Hugging Face names, and it composes with FSDP2.

    Args:
        module: The module (a transformer block) to checkpoint in place.

    Returns:
        The same module.
    """
    from torch.distributed._composable import checkpoint

    return checkpoint(module)
