"""Linear weights prepacked for oneDNN, for a block of inference-only forwards on CPU (rollouts).

A decode step multiplies a few dozen rows by every weight of the model, once per generated
token. On CPU in fp32, ``F.linear`` runs MKL's sgemm, which re-lays the weight out for its
kernel on every call; a weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplied with ``_linear_pointwise`` skips
that. Measured on one core of this project's AMD EPYC (torch 2.13, 32 rows, the bench's
768-wide model; docs/benchmarks.md): 1.05-1.5x faster per matmul, a whole ``generate`` 11-15%
less CPU time.

Results equal ``F.linear``'s up to rounding (a few 1e-6 at these sizes, as merged adapters
are); a row's values do not depend on how many rows share the call, except for a row alone
(MKL's own sgemm differs for 1-3 rows), which the shared prefill and the compaction of the
rollout engine rely on. Packed weights have no autograd and do not go through
``torch.compile``: inference only, eager only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["linear", "pack_weight", "packable", "packed_linears"]


def packable(weight: torch.Tensor | None) -> bool:
    """Whether ``weight`` can run packed: a plain fp32 matrix on CPU, oneDNN in this build."""
    return (
        weight is not None
        and type(weight) in (torch.Tensor, nn.Parameter)  # not a DTensor, NF4 or packed one
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and not weight.is_mkldnn
        and torch.backends.mkldnn.is_available()
    )


def pack_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` (``[out, in]``) in oneDNN's layout for about ``rows`` input rows (a new tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, with ``weight`` plain or packed by :func:`pack_weight`."""
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(
        x.reshape(-1, x.shape[-1]), weight, bias, "none", [], ""
    )
    return out.view(*x.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int) -> Iterator[int]:
    """Run ``model``'s linear layers on packed weights inside the ``with`` block (no grad).

    Two kinds of layer: a plain ``nn.Linear`` runs a packed copy of its weight (its parameter
    untouched; the copy dropped on exit), and a layer holding a temporary ``merged_weight``
    (``tunelab.peft.merged_adapters``) has that copy replaced by its packed form, so it costs
    no memory of its own; it stays packed until ``merged_adapters`` drops it (its sublayers,
    which it no longer calls, are skipped). Weights that are not :func:`packable` (sharded,
    quantized, another dtype or device) are left as they are.

    Args:
        model: The model; its weights must not change inside the block.
        rows: About how many rows each forward multiplies (the decode batch).

    Yields:
        The number of layers packed.
    """
    overridden: list[nn.Module] = []
    packed = 0
    # A layer that runs its merged weight calls none of its sublayers (LoRA's A and B).
    unused = {
        id(sublayer)
        for module in model.modules()
        if getattr(module, "merged_weight", None) is not None
        for sublayer in module.modules()
        if sublayer is not module
    }
    try:
        with torch.no_grad():
            for module in model.modules():
                if id(module) in unused:
                    continue
                if type(module) is nn.Linear and packable(module.weight):
                    forward = functools.partial(
                        linear, weight=pack_weight(module.weight, rows), bias=module.bias
                    )
                    module.forward = forward  # an instance attribute: shadows the method
                    overridden.append(module)
                    packed += 1
                elif packable(getattr(module, "merged_weight", None)):
                    module.merged_weight = pack_weight(module.merged_weight, rows)
                    packed += 1
        yield packed
    finally:
        for module in overridden:
            del module.forward
