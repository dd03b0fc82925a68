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
rollout engine rely on. Packed weights do not go through ``torch.compile``: eager only.

Training uses them for frozen weights (:func:`packed_frozen_linears`: a LoRA run's base,
``lm_head``): a frozen layer's two matmuls per pass, the forward ``x W^T`` and the input
gradient ``g W``, each run on a weight packed for it, ``W`` or ``W^T``, at the update's row
counts (1664 rows of the bench's wide-16 step: 11-20% less CPU per matmul than MKL's sgemm).
The weight has no gradient, so nothing else of the backward changes; the results equal the
unpacked pass up to fp32 rounding (tests/unit/test_packed_linear.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PackedProjection",
    "frozen_linear",
    "linear",
    "pack_weight",
    "packable",
    "packed_frozen_linears",
    "packed_linears",
]


def _plain_cpu_fp32(tensor: torch.Tensor) -> bool:
    """A plain fp32 tensor on CPU (not a DTensor, NF4 or packed one)."""
    return (
        type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.device.type == "cpu"
        and tensor.dtype == torch.float32
    )


def packable(weight: torch.Tensor | None) -> bool:
    """Whether ``weight`` can run packed: a plain fp32 matrix on CPU, oneDNN in this build."""
    return (
        weight is not None
        and _plain_cpu_fp32(weight)
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
    if x.dim() >= 2:  # oneDNN folds the leading dims itself (no view in, none out)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(x[None], weight, bias, "none", [], "")
    return out[0]


class PackedProjection:
    """Sibling projections of one input (q/k/v, gate/up) as one packed matrix.

    Their weights concatenated by output rows and packed once: one oneDNN call computes all
    of them, and ``__call__`` splits its output back. Each output element is the dot product
    of the same row and the same weight row as in the separate calls: bit for bit the same on
    the CPUs the tests run on (tests/unit/test_packed_linear.py checks it at the shapes of the
    tiny and the bench's wide model), where only the number of calls changes.

    Args:
        weight: The concatenated weight, packed (:func:`pack_weight`).
        bias: The concatenated bias, or None.
        sizes: Each projection's output features, in order.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]) -> None:
        self.weight = weight
        self.bias = bias
        self.sizes = sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each projection's output ``[..., size]`` (views of one result)."""
        return linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def _plain_linear(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The weight and bias ``module`` multiplies by as one packable linear, or None."""
    merged = getattr(module, "merged_weight", None)
    if merged is not None and not getattr(module, "disabled", False):
        weight = merged
    elif type(module) is nn.Linear:
        weight = module.weight
    else:
        return None
    bias = module.bias
    plain_bias = bias is None or _plain_cpu_fp32(bias)
    return (weight, bias) if packable(weight) and plain_bias else None


def _fuse_siblings(module: nn.Module, rows: int) -> list[nn.Module]:
    """Give ``module`` its siblings as one :class:`PackedProjection`; returns them ([]: none).

    A sibling's merged copy (``merged_weight``) is dropped: the packed matrix replaces it, so
    it costs no memory of its own. It is not rebuilt on exit (that would cost a reorder per
    group and call): a sibling called after the block but still inside ``merged_adapters``
    runs unmerged, the same values up to rounding.
    """
    siblings = module.sibling_projections()
    linears = [_plain_linear(sibling) for sibling in siblings]
    if len(siblings) < 2 or any(pair is None for pair in linears):
        return []
    biases = [bias for _, bias in linears]
    if any(bias is None for bias in biases) and any(bias is not None for bias in biases):
        return []
    weight = pack_weight(torch.cat([weight for weight, _ in linears]), rows)
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    module.packed_projection = PackedProjection(
        weight, bias, [weight.shape[0] for weight, _ in linears]
    )
    for sibling in siblings:
        if getattr(sibling, "merged_weight", None) is not None:
            sibling.merged_weight = None
    return siblings


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int) -> Iterator[int]:
    """Run ``model``'s linear layers on packed weights inside the ``with`` block (no grad).

    Two kinds of layer: a plain ``nn.Linear`` runs a packed copy of its weight (its parameter
    untouched; the copy dropped on exit), and a layer holding a temporary ``merged_weight``
    (``tunelab.peft.merged_adapters``) has that copy replaced by its packed form, so it costs
    no memory of its own; it stays packed until ``merged_adapters`` drops it (its sublayers,
    which it no longer calls, are skipped). Weights that are not :func:`packable` (sharded,
    quantized, another dtype or device) are left as they are.

    Sibling projections of one input (an attention's q/k/v, a gated MLP's gate/up: a module
    with ``sibling_projections``) whose weights all run packed become one packed matrix, a
    :class:`PackedProjection` set on the module as ``packed_projection`` (one matmul where
    there were three or two); their merged copies make way for it (and stay dropped after the
    block: a merged sibling then runs unmerged until ``merged_adapters`` ends).

    Args:
        model: The model; its weights must not change inside the block.
        rows: About how many rows each forward multiplies (the decode batch).

    Yields:
        The number of layers packed.
    """
    overridden: list[nn.Module] = []
    fused: list[nn.Module] = []
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
                if hasattr(module, "sibling_projections") and id(module) not in unused:
                    siblings = _fuse_siblings(module, rows)
                    if siblings:
                        fused.append(module)
                        packed += 1
                        # The siblings (and their adapters) are not called in the block.
                        unused.update(id(sub) for sibling in siblings for sub in sibling.modules())
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
        for module in fused:
            module.packed_projection = None


class _FrozenPacks:
    """A frozen layer's packed ``W`` and ``W^T``, kept between passes or packed per call.

    A kept pack is reused while the weight is the same tensor, unchanged (its storage and
    version counter); otherwise (FSDP2 gathering a sharded base anew, a weight written in
    place) it is packed again. Packing does not depend on the row count it is given (the
    same bits for 1 to 4096 rows), so a kept pack and a fresh one give the same results.
    """

    def __init__(self) -> None:
        self.hold = False
        self._packs: dict[bool, tuple[tuple, torch.Tensor]] = {}

    def get(self, weight: torch.Tensor, transposed: bool, rows: int) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        kept = self._packs.get(transposed)
        if kept is not None and kept[0] == key:
            return kept[1]
        packed = pack_weight(weight.t() if transposed else weight, rows)
        if self.hold:
            self._packs[transposed] = (key, packed)
        return packed

    def clear(self) -> None:
        self._packs.clear()

    def __deepcopy__(self, memo: dict) -> _FrozenPacks:
        # A cache of the layer's weights (oneDNN's opaque tensors cannot be copied): a copied
        # model packs its own weights when it first needs them.
        copy = _FrozenPacks()
        copy.hold = self.hold
        return copy


class _FrozenLinear(torch.autograd.Function):
    """``F.linear(x, W, b)`` with ``W`` and ``b`` frozen: both matmuls on packed weights.

    Forward ``x W^T + b`` on ``W`` packed; backward only ``dL/dx = g W``, as ``g (W^T)^T`` on
    ``W^T`` packed (:class:`_FrozenPacks`: kept between passes, or packed in the call that
    uses it and dropped after it). ``W`` is saved for the backward as ``F.linear`` saves it,
    so FSDP2 gathers it again for the backward as it would for ``F.linear``.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packs: _FrozenPacks,
    ) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(weight)
            ctx.packs = packs
        return linear(x, packs.get(weight, False, rows), bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        (weight,) = ctx.saved_tensors
        rows = grad_out.numel() // grad_out.shape[-1]
        return linear(grad_out, ctx.packs.get(weight, True, rows), None), None, None, None


def _frozen_bias(bias: torch.Tensor | None) -> bool:
    return bias is None or (
        type(bias) in (torch.Tensor, nn.Parameter)
        and not bias.requires_grad
        and bias.dtype == torch.float32
        and bias.device.type == "cpu"
    )


def frozen_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packs: _FrozenPacks | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; on packed weights when they are frozen fp32 CPU tensors.

    The packed path (:class:`_FrozenLinear`) takes a :func:`packable` weight and bias that
    need no gradient and a plain fp32 input with rows, outside ``torch.compile`` and autocast;
    anything else (a trainable, sharded, quantized or bf16 weight, a DTensor input) runs
    ``F.linear`` as it is.

    Args:
        x: Input ``[..., in]``.
        weight: ``[out, in]``.
        bias: ``[out]`` or None.
        packs: Where the layer keeps its packed weights (:func:`packed_frozen_linears`);
            None: packed for the call.

    Returns:
        ``[..., out]``.
    """
    if (
        packable(weight)
        and not weight.requires_grad
        and _frozen_bias(bias)
        and type(x) is torch.Tensor
        and x.dtype == torch.float32
        and x.numel() > 0
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled("cpu")
    ):
        return _FrozenLinear.apply(x, weight, bias, packs or _FrozenPacks())
    return F.linear(x, weight, bias)


def _frozen_module_forward(module: nn.Linear, packs: _FrozenPacks, x: torch.Tensor) -> torch.Tensor:
    # The module's parameters read at the call: under FSDP2 the gathered ones.
    return frozen_linear(x, module.weight, module.bias, packs)


def _may_hold(layers: list[nn.Module], hold_bytes: int) -> bool:
    """Whether the packed ``W`` and ``W^T`` of ``layers`` fit in ``hold_bytes``."""
    weights = [layer.weight for layer in layers]
    size = sum(2 * w.numel() * 4 for w in weights if w.dtype == torch.float32)
    return size <= hold_bytes


@contextlib.contextmanager
def packed_frozen_linears(model: nn.Module, *, hold_bytes: int = 0) -> Iterator[int]:
    """Run ``model``'s frozen linear layers on packed weights inside the ``with`` block.

    For training passes (forward and backward inside the block): a frozen layer's forward
    runs on its weight packed, its input gradient on the transpose packed
    (:func:`frozen_linear`). Two kinds of layer: a plain ``nn.Linear`` whose parameters need
    no gradient (``lm_head``, the projections a LoRA run does not adapt) calls
    :func:`frozen_linear` for the block, and a layer with a ``pack_frozen`` attribute
    (``tunelab.peft.LoRALinear``) computes its base term with it. The decision is made at
    each call, on the tensors the layer then holds (FSDP2's gathered weights, which are plain
    tensors; tensor-parallel, NF4 or bf16 weights run ``F.linear``), so one process and
    several, a resumed run and an uninterrupted one, take the same path. Layers inside a
    block compiled with ``Module.compile`` are left alone (their graph runs ``F.linear``).

    Memory: the packed ``W`` and ``W^T`` are kept on each layer for the next pass (twice
    the frozen fp32 weights, held for the run) when they fit in ``hold_bytes``; otherwise
    each call packs what it multiplies and drops it (one layer's pack at a time, about 5% of
    a 1664-row matmul's time).

    Args:
        model: The model.
        hold_bytes: What the kept packs may take; 0 (GRPO's update: kept packs would hold
            the frozen base twice more beside the rollout's weights): pack per call.

    Yields:
        The number of layers set up.
    """
    # A compiled block (``compile: true``) runs F.linear in its graph anyway; setting its
    # layers up would only change what its guards see, and recompile it each pass.
    compiled = {
        id(sublayer)
        for module in model.modules()
        if getattr(module, "_compiled_call_impl", None) is not None
        for sublayer in module.modules()
    }
    adapted, plain = [], []
    for module in model.modules():
        if id(module) in compiled:
            continue
        if getattr(module, "pack_frozen", False) is None:
            adapted.append(module)
        elif (
            type(module) is nn.Linear
            and "forward" not in module.__dict__  # not already run packed (nested blocks)
            and not any(param.requires_grad for param in module.parameters())
        ):
            plain.append(module)
    hold = _may_hold(adapted + plain, hold_bytes)
    try:
        for module in adapted + plain:
            packs = module.__dict__.setdefault("_frozen_packs", _FrozenPacks())
            packs.hold = hold
            if not hold:
                packs.clear()
            if type(module) is nn.Linear:  # an instance attribute: shadows the method
                module.forward = functools.partial(_frozen_module_forward, module, packs)
            else:
                module.pack_frozen = packs
        yield len(adapted) + len(plain)
    finally:
        for module in adapted:
            module.pack_frozen = None
        for module in plain:
            module.__dict__.pop("forward", None)
