"""QLoRA's frozen base: linear weights in NF4, quantized shard by shard as they load.

QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs",
arXiv:2305.14314) stores each frozen linear weight in 4-bit NormalFloat: the flattened weight
is cut into blocks of 64 values, each block is scaled by its absolute maximum ``a_b`` and every
value rounded to the nearest of 16 NF4 levels. The block scales are quantized again (double
quantization): ``c_b = a_b - mean(a)`` in blocks of 256 scales, each block ``int8(round(c_b *
256 / (2 max|c|)))``. torchao's ``NF4Tensor`` holds the result and dequantizes on the fly in
``F.linear``; FSDP2 all-gathers its packed bytes (``fsdp_pre_all_gather``).

Every step is local to its blocks except one: ``mean(a)``, a scalar over the whole weight. So a
rank holding rows ``[i, j)`` of a weight (FSDP2's ``Shard(0)``) quantizes them alone once it has
that mean, and the mean comes from one all-gather of the block maxima (1/64 of the rows'
values). The result equals ``torchao.quantization.to_nf4`` of the whole weight, split by rows,
bit for bit, and no rank ever holds a whole weight in full precision. For that the rows of one
rank must hold whole blocks of scales: ``rows * in_dim`` divisible by ``64 * 256 = 16384``.
A weight that is not (a tiny model's, or one whose rows do not split evenly over the ranks)
stays in the training dtype, and :func:`quantize_base_nf4` returns its name.

Stacked mixture-of-experts weights (``MoEExperts.gate_up_proj`` / ``down_proj``, ``[E, rows,
cols]`` in either layout, gpt-oss's ``[E, in, out]`` included) are quantized the same way, as
the 2-D ``[E * rows, cols]`` tensor of their experts one after another (torchao's ``NF4Tensor``
is 2-D only, and FSDP2 needs its row ops): the codes are ``to_nf4`` of that reshape, and each
projection unpacks its layer's experts for its grouped matmul (``MoEExperts.unpack_weight``),
in the backward again. FSDP2 shards the rows, so a rank holds whole experts when ``E`` divides
by the processes; otherwise, or when a rank's experts hold no whole block of scales, the
weight stays in the training dtype. Under expert parallelism
(``tunelab.distributed.expert_parallel``) each rank packs and quantizes its own experts (a
``DTensor`` ``Shard(0)`` over the expert mesh, which FSDP2 does not shard further), the rows
of the packed weight one process would give them. :func:`dequantize_experts` gives the
``[E, rows, cols]`` values back (a merge adds each rank's own experts' updates to them).

Under tensor parallelism (``tunelab.distributed.tensor_parallel``) each rank of the ``"tp"``
mesh holds a block of rows (column-wise layers, ``Shard(0)``) or of columns (row-wise layers,
``Shard(1)``) of each weight, and quantizes only that block, to the same NF4 bytes a
one-process quantization of the whole weight gives for those values. Rows are handled as
above. A block of columns holds whole 64-value blocks when its width divides by 64, but its
blocks, read in its own row-major order, interleave several 256-block groups of the whole
weight, each with its own scale factor: such a piece gets a smaller ``scaler_block_size``,
the largest one whose groups of consecutive blocks each lie in one group of the whole weight
(``_column_split_scaler_block_size``; 128 for a 2-way split of a weight whose 256 blocks span
whole rows), and every group keeps the whole weight's factor. A ``Shard(1)`` piece's block
maxima are all-gathered whole (its mean and factors need them), 1/64 of the weight's values.
:func:`linear` computes with such a piece (the torchao ``F.linear`` of an ``NF4Tensor`` does
not see through a ``DTensor``): it dequantizes this rank's piece only, in the forward and
again in the backward, as torchao's ``linear_nf4`` does with a whole weight.

The model is quantized on the meta device, before ``fully_shard``: FSDP2 then shards the
``NF4Tensor`` by rows, ``to_empty`` allocates the packed shards, and the loader fills them with
:func:`copy_rows_nf4_`. On an HSDP mesh whose shard groups have one rank (``replicate x 1``),
FSDP2 copies instead of gathering, and ``_nf4_fsdp`` adapts torchao's hooks to that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tunelab._torch_compat import local_shape_and_global_offset
from tunelab.errors import ConfigError
from tunelab.modules.moe import MoEExperts, MoERouter
from tunelab.peft._nf4_compile import hash_nf4_for_compile_caches
from tunelab.peft._nf4_fsdp import gather_one_tensor_on_one_rank

NF4_BLOCK_SIZE = 64
"""Values per quantization block (the QLoRA paper's setting)."""
NF4_SCALER_BLOCK_SIZE = 256
"""Block scales per double-quantization block (the QLoRA paper's setting)."""
_ROW_GRANULE = NF4_BLOCK_SIZE * NF4_SCALER_BLOCK_SIZE
# The output layers: a causal LM's lm_head, a sequence classifier's score head.
_OUTPUT_LAYERS = ("lm_head", "score")


def _torchao_nf4() -> tuple[type, Callable[..., torch.Tensor]]:
    """``(NF4Tensor, to_nf4)`` from torchao (0.18 moved them to ``torchao.quantization``)."""
    try:
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError:  # torchao before 0.18
        try:
            from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
        except ImportError as error:
            raise ConfigError(
                "lora.quantize_base: nf4 needs torchao (pip install 'torchao>=0.18')"
            ) from error
    # HSDP with one rank per shard group (replicate x 1) needs one all-gather input.
    gather_one_tensor_on_one_rank(NF4Tensor)
    # compile: true names NF4 inputs in its caches without a warning per block.
    hash_nf4_for_compile_caches(NF4Tensor)
    return NF4Tensor, to_nf4


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a DTensor's local shard) is a torchao ``NF4Tensor``."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return type(tensor).__name__ == "NF4Tensor"


def dequantize(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``tensor``'s values: an NF4 weight dequantized, anything else itself.

    For a DTensor, the local shard is dequantized and wrapped with the same mesh and placements
    (no communication).
    """
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        if not is_nf4(local):
            return tensor
        return placed_like(tensor, local.get_original_weight())
    return tensor.get_original_weight() if is_nf4(tensor) else tensor


def placed_like(like: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` as this rank's piece of a DTensor with ``like``'s mesh, placements and shape.

    No communication: ``local`` must be this rank's piece of a tensor laid out as ``like``.
    """
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def dequantize_experts(tensor: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A stacked expert weight's ``[E, rows, cols]`` values, packed (NF4) or not.

    A packed weight is 2-D ``[E * rows, cols]`` (see the module docstring); a DTensor's local
    shard holds whole experts and is dequantized alone, into a ``[E, rows, cols]`` DTensor of
    the same mesh and placements (no communication). A 3-D weight is returned as it is.

    Args:
        tensor: The stored weight, plain, NF4, or a DTensor of either.
        num_experts: ``E``.

    Returns:
        ``[E, rows, cols]`` in the training dtype.
    """
    if tensor.dim() == 3:
        return tensor
    shape = (num_experts, tensor.shape[0] // num_experts, tensor.shape[1])
    if isinstance(tensor, DTensor):
        local = dequantize(tensor.to_local())
        return DTensor.from_local(
            local.view(-1, *shape[1:]),
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    return dequantize(tensor).view(shape)


def _unpack_nf4(packed: torch.Tensor) -> torch.Tensor:
    """``MoEExperts.unpack_weight`` for NF4 experts: the whole (gathered) weight's values.

    Bit for bit ``packed.get_original_weight()`` (each value is its NF4 level times its block's
    scale, one multiplication in the weight's dtype), with less memory on the way: torchao
    widens every 4-bit code to an int64 index (8 bytes a value, 7.5 GB for one Mixtral layer's
    ``gate_up_proj``); here one int32 index per byte picks both of its values from a 256 x 2
    table (2 bytes a value).
    """
    levels = packed.nf4
    # Byte b holds the codes b >> 4 (first value) and b & 15 (second value).
    table = torch.stack([levels.repeat_interleave(16), levels.repeat(16)], dim=1)
    values = table[packed.quantized_data.int()].view(-1, packed.block_size)
    scales = packed.dequantize_scalers(
        packed.quantized_scalers, packed.quantization_factor, packed.scaler_block_size
    )
    return values.mul_(scales.unsqueeze(1)).view(packed.shape)


def _quantizable(weight: torch.Tensor, world_size: int) -> tuple[str | None, int]:
    """Why ``weight`` (plain, or a tensor-parallel DTensor piece) stays unquantized, or None.

    Also returns the ``scaler_block_size`` its (local) ``NF4Tensor`` takes: 256, or less for
    a tensor-parallel block of columns (see the module docstring).
    """
    if not isinstance(weight, DTensor):
        return _why_not_quantizable(*weight.shape, world_size), NF4_SCALER_BLOCK_SIZE
    (placement,) = weight.placements  # the "tp" mesh (1-D): FSDP2 comes later
    rows, cols = weight.to_local().shape
    if placement.is_shard(0):
        return _why_not_quantizable(rows, cols, world_size), NF4_SCALER_BLOCK_SIZE
    if not placement.is_shard(1):
        return f"placed {placement} by tensor parallelism, not split by rows or columns", 0
    if cols % NF4_BLOCK_SIZE:
        return (
            f"{cols} columns per tensor-parallel rank are not a multiple of {NF4_BLOCK_SIZE}",
            0,
        )
    if rows % world_size:
        return f"{rows} rows do not split evenly over {world_size} processes", 0
    if weight.numel() % _ROW_GRANULE:  # one process's NF4 needs whole groups of scales
        return (
            f"{rows} x {weight.shape[1]} values are not a multiple of "
            f"{NF4_BLOCK_SIZE} x {NF4_SCALER_BLOCK_SIZE}",
            0,
        )
    return None, _column_split_scaler_block_size(
        weight.shape[0], weight.shape[1], weight.device_mesh.size(), world_size
    )


def _column_split_scaler_block_size(out_dim: int, in_dim: int, tp: int, shards: int) -> int:
    """The largest scaler block size of every ``[out_dim, in_dim / tp]`` column block.

    Each run of that many consecutive blocks (in the piece's row-major order) lies in one
    256-block group of the whole weight, and the rows FSDP2 gives each of ``shards``
    processes hold whole runs.
    """
    per_row = in_dim // NF4_BLOCK_SIZE
    local = per_row // tp
    size = out_dim // shards * local  # one FSDP2 shard's blocks
    rows = torch.arange(out_dim).unsqueeze(1) * per_row
    for rank in range(tp):
        group = ((rows + rank * local + torch.arange(local)).flatten()) // NF4_SCALER_BLOCK_SIZE
        starts = (group[1:] != group[:-1]).nonzero().flatten() + 1
        size = math.gcd(size, *starts.tolist())
    return size


def _why_not_quantizable(out_dim: int, in_dim: int, world_size: int) -> str | None:
    if out_dim % world_size:
        return f"{out_dim} rows do not split evenly over {world_size} processes"
    if (out_dim // world_size) * in_dim % _ROW_GRANULE:
        return (
            f"{out_dim // world_size} x {in_dim} values per process are not a multiple of "
            f"{NF4_BLOCK_SIZE} x {NF4_SCALER_BLOCK_SIZE}"
        )
    return None


@dataclass
class NF4Plan:
    """What :func:`quantize_base_nf4` did."""

    quantized: list[str] = field(default_factory=list)
    """FQNs of the weights now in NF4."""
    kept: dict[str, str] = field(default_factory=dict)
    """FQN -> why the weight stays in the training dtype."""


def quantize_base_nf4(
    model: nn.Module, *, device: torch.device, world_size: int = 1, skip: tuple[str, ...] = ()
) -> NF4Plan:
    """Turn every frozen linear weight of a meta-device model into an (empty) ``NF4Tensor``.

    Stacked MoE expert weights too, as 2-D ``[E * rows, cols]`` (see the module docstring).
    Call it after ``apply_lora`` and before ``fully_shard``, on the meta device; then
    ``to_empty`` allocates the packed bytes and :func:`copy_rows_nf4_` fills them as the
    checkpoint loads. The LoRA ``A``/``B`` weights, DoRA magnitudes, biases, norms and
    embeddings stay in the training dtype, and so does the output layer ``lm_head`` (its
    rows are the vocabulary, and a tied one is the embedding). QLoRA covers the language
    model: a vision-language model's vision tower and projector (the module prefixes of its
    ``vision_parts``) stay in the training dtype too, frozen, adapted or trained whole; they
    are a small share of the weights, and the image features every later layer reads come
    from them.

    Args:
        model: A model on the meta device, with or without LoRA.
        device: The device the model will be materialised on (NF4's 16-value table lives there).
        world_size: Processes the weights will be sharded over (rows per process must hold
            whole blocks of scales).
        skip: Last FQN components never to quantize, beside ``lm_head``.

    Returns:
        The quantized FQNs and, for each weight left in the training dtype, the reason.

    Raises:
        ConfigError: If torchao is missing, or the model is not on the meta device.
    """
    _, to_nf4 = _torchao_nf4()
    plan = NF4Plan()
    tables: dict[torch.dtype, torch.Tensor] = {}
    vision = tuple(
        prefix for prefixes in getattr(model, "vision_parts", {}).values() for prefix in prefixes
    )
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        leaf = name.rpartition(".")[2]
        if (
            weight is None
            or weight.dim() != 2
            or leaf in (*_OUTPUT_LAYERS, "lora_A", "lora_B", *skip)
            or not _is_linear(module)
            or weight.requires_grad
        ):
            continue
        if not weight.is_meta:
            raise ConfigError(
                f"quantize_base_nf4: {name}.weight is materialised; quantize on the meta device"
            )
        reason, scaler_block_size = _quantizable(weight, world_size)
        if name.startswith(vision):
            reason = "the vision tower or projector: QLoRA quantizes the language model only"
        elif isinstance(module, MoERouter):
            reason = "an MoE router: its few weights decide the routing"
        if reason is not None:
            plan.kept[name] = reason
            continue
        module.weight = _empty_nf4(weight, to_nf4, tables, device, scaler_block_size)
        if isinstance(weight, DTensor) and not hasattr(module, "lora_A"):
            # An nn.Linear's F.linear would not reach the NF4 piece inside the DTensor.
            module.forward = _linear_forward.__get__(module)
        plan.quantized.append(name)
    for name, module in model.named_modules():
        if isinstance(module, MoEExperts):
            _quantize_experts(name, module, world_size, plan, to_nf4, tables, device)
    return plan


def _empty_nf4(
    weight: torch.Tensor,
    to_nf4: Callable[..., torch.Tensor],
    tables: dict[torch.dtype, torch.Tensor],
    device: torch.device,
    scaler_block_size: int = NF4_SCALER_BLOCK_SIZE,
) -> nn.Parameter:
    """The frozen NF4 parameter of a 2-D meta weight (its values come at load).

    A tensor-parallel ``DTensor`` weight becomes a ``DTensor`` of the same mesh, placements,
    shape and stride whose local piece is the ``NF4Tensor``.
    """
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    quantized = to_nf4(local.detach(), NF4_BLOCK_SIZE, scaler_block_size)
    # The two tensors FSDP2 does not shard are shared by every row shard: make them real
    # now, so that to_empty (which allocates only the sharded ones) leaves none on meta.
    if weight.dtype not in tables:
        tables[weight.dtype] = _nf4_levels(to_nf4, weight.dtype, device)
    quantized.nf4 = tables[weight.dtype]
    quantized.scaler_mean = torch.zeros((), dtype=weight.dtype, device=device)
    if isinstance(weight, DTensor):
        quantized = placed_like(weight, quantized)
    return nn.Parameter(quantized, requires_grad=False)


def _quantize_experts(
    name: str,
    experts: MoEExperts,
    world_size: int,
    plan: NF4Plan,
    to_nf4: Callable[..., torch.Tensor],
    tables: dict[torch.dtype, torch.Tensor],
    device: torch.device,
) -> None:
    """Pack an ``MoEExperts``' frozen stacked weights as 2-D NF4 ``[E * rows, cols]``."""
    for projection in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, projection)
        fqn = f"{name}.{projection}"
        if weight.requires_grad or weight.dim() != 3:
            continue
        if not weight.is_meta:
            raise ConfigError(
                f"quantize_base_nf4: {fqn} is materialised; quantize on the meta device"
            )
        # Under expert parallelism a DTensor of this rank's experts, which FSDP2 leaves alone.
        split = isinstance(weight, DTensor)
        local = weight.to_local() if split else weight
        shards = 1 if split else world_size
        num_experts, rows, cols = local.shape
        if num_experts % shards:
            plan.kept[fqn] = f"{num_experts} experts do not split evenly over {shards} processes"
            continue
        reason = _why_not_quantizable(num_experts * rows, cols, shards)
        if reason is not None:
            plan.kept[fqn] = reason
            continue
        packed = local.detach().reshape(num_experts * rows, cols)
        if split:
            packed = DTensor.from_local(
                packed,
                weight.device_mesh,
                weight.placements,
                run_check=False,
                shape=torch.Size((weight.shape[0] * rows, cols)),
                stride=(cols, 1),
            )
        setattr(experts, projection, _empty_nf4(packed, to_nf4, tables, device))
        experts.unpack_weight = _unpack_nf4
        plan.quantized.append(fqn)


def _is_linear(module: nn.Module) -> bool:
    # A LoRALinear (which imports this module) carries its base weight like an nn.Linear.
    return isinstance(module, nn.Linear) or hasattr(module, "lora_A")


def _nf4_levels(to_nf4: Callable[..., torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
    """The table of the 16 NF4 levels torchao uses, in ``dtype`` on ``device``."""
    return to_nf4(torch.ones(_ROW_GRANULE, dtype=dtype, device=device)).nf4


def _block_absmax(values: torch.Tensor, block_size: int) -> torch.Tensor:
    return values.reshape(-1, block_size).abs().amax(dim=1)


def quantize_rows_nf4(
    rows: torch.Tensor, scaler_mean: torch.Tensor, levels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize whole rows of a weight whose block-scale mean is known.

    Args:
        rows: ``[num_rows, in_dim]`` values, ``num_rows * in_dim`` a multiple of 16384.
        scaler_mean: The mean of the 64-value block maxima over the whole weight.
        levels: torchao's table of the 16 NF4 levels (an ``NF4Tensor``'s ``nf4``).

    Returns:
        ``(quantized_scalers int8, quantization_factor, quantized_data uint8)``, torchao's
        layout for these rows.
    """
    nf4_tensor, _ = _torchao_nf4()
    flat = rows.reshape(-1)
    centred = _block_absmax(flat, NF4_BLOCK_SIZE) - scaler_mean
    factor = 256 / (2 * _block_absmax(centred, NF4_SCALER_BLOCK_SIZE))
    scalers = (
        (centred.view(-1, NF4_SCALER_BLOCK_SIZE) * factor.unsqueeze(1))
        .round()
        .clamp(-128, 127)
        .flatten()
        .to(torch.int8)
    )
    data = nf4_tensor.convert_to_norm_float_weight(
        rows, flat.numel() // NF4_BLOCK_SIZE, NF4_BLOCK_SIZE, levels
    )
    return scalers, factor, data


def _scaler_mean(rows: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The mean of the block maxima over the whole weight, from this rank's rows.

    Under FSDP2 the maxima of the ranks sharing the weight's rows are all-gathered (equal-sized
    shards, in rank order; under HSDP, over the mesh dimension that shards), so the mean is
    computed over the same vector in the same order as a one-process quantization.
    """
    absmax = _block_absmax(rows, NF4_BLOCK_SIZE)
    if not isinstance(param, DTensor):
        return absmax.mean()
    # The mesh dimensions that shard the rows (HSDP's 2-D mesh also has a replicating one),
    # outermost first: under FSDP2 x TP, FSDP2's ``_StridedShard(0)`` cuts each tp rank's
    # rows (it is not ``is_shard(0)`` in torch 2.13, hence the ``dim``), so the ranks of a
    # tp block are gathered before the tp blocks.
    for dim, placement in enumerate(param.placements):
        if getattr(placement, "dim", None) == 0 and param.device_mesh.size(dim) > 1:
            group = param.device_mesh.get_group(dim)
            parts = [torch.empty_like(absmax) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, absmax, group=group)
            absmax = torch.cat(parts)
    return absmax.mean()


@torch.no_grad()
def copy_rows_nf4_(param: torch.Tensor, rows: torch.Tensor) -> None:
    """Fill a parameter with this rank's rows, quantizing them if the parameter is NF4.

    A collective for NF4 DTensors (one all-gather of the block maxima): every rank calls it
    for the same weights in the same order. Any other parameter gets a plain copy.

    Args:
        param: A parameter after ``to_empty``: plain, NF4, or a DTensor of either.
        rows: This rank's rows of the checkpoint tensor, in any floating dtype.
    """
    local = param.to_local() if isinstance(param, DTensor) else param
    if not is_nf4(local):
        local.copy_(rows)
        return
    # A stacked expert weight's rows come as [experts, rows, cols]; it is packed 2-D.
    rows = rows.to(local.dtype).reshape(local.shape).contiguous()
    if isinstance(param, DTensor) and any(p.is_shard(1) for p in param.placements):
        _copy_columns_nf4_(param, local, rows)
        return
    scaler_mean = _scaler_mean(rows, param)
    scalers, factor, data = quantize_rows_nf4(rows, scaler_mean, local.nf4)
    local.quantized_scalers.copy_(scalers)
    local.quantization_factor.copy_(factor)
    local.quantized_data.copy_(data)
    local.scaler_mean.copy_(scaler_mean)


def _copy_columns_nf4_(param: DTensor, local: torch.Tensor, rows: torch.Tensor) -> None:
    """``copy_rows_nf4_`` for a tensor-parallel block of columns (see the module docstring).

    The block maxima of the whole weight are all-gathered (in its row-major block order, the
    order a one-process quantization reads them in); the mean, each 256-block group's factor
    and this block's int8 scales are then the whole weight's, bit for bit.
    """
    (num_rows, num_cols), (row0, col0) = local_shape_and_global_offset(param)
    out_dim, in_dim = param.shape
    per_row = in_dim // NF4_BLOCK_SIZE
    absmax = _block_absmax(rows, NF4_BLOCK_SIZE)
    whole = DTensor.from_local(
        absmax.view(num_rows, num_cols // NF4_BLOCK_SIZE),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=torch.Size((out_dim, per_row)),
        stride=(per_row, 1),
    ).full_tensor()
    whole = whole.reshape(-1)
    scaler_mean = whole.mean()
    centred = whole - scaler_mean
    factors = 256 / (2 * _block_absmax(centred, NF4_SCALER_BLOCK_SIZE))
    # The whole weight's index of each of this block's 64-value blocks, in its own order.
    index = (torch.arange(num_rows, device=rows.device).unsqueeze(1) + row0) * per_row
    index = index + col0 // NF4_BLOCK_SIZE
    index = (index + torch.arange(num_cols // NF4_BLOCK_SIZE, device=rows.device)).flatten()
    factor = factors[index // NF4_SCALER_BLOCK_SIZE]
    scalers = (centred[index] * factor).round().clamp(-128, 127).to(torch.int8)
    nf4_tensor, _ = _torchao_nf4()
    data = nf4_tensor.convert_to_norm_float_weight(rows, index.numel(), NF4_BLOCK_SIZE, local.nf4)
    local.quantized_scalers.copy_(scalers)
    local.quantization_factor.copy_(factor.view(-1, local.scaler_block_size)[:, 0])
    local.quantized_data.copy_(data)
    local.scaler_mean.copy_(scaler_mean)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, also for a tensor-parallel NF4 weight (a ``DTensor`` of an ``NF4Tensor``).

    Such a weight's piece is dequantized on this rank only (no communication), in the forward
    and again in the backward, so no full-precision copy outlives the forward; DTensor plans
    the matmul as for a plain split weight. Anything else goes to ``F.linear`` (a plain
    ``NF4Tensor`` takes torchao's ``linear_nf4`` there).

    Args:
        x: Input ``[..., in_dim]`` (a DTensor under tensor parallelism).
        weight: ``[out_dim, in_dim]``.
        bias: ``[out_dim]`` or None.

    Returns:
        ``x @ weight.T + bias``.
    """
    if not (isinstance(weight, DTensor) and is_nf4(weight.to_local())):
        return F.linear(x, weight, bias)
    out = _SplitNF4Linear.apply(x, weight)
    return out if bias is None else out + bias


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # The forward of an nn.Linear whose weight is a tensor-parallel NF4 piece.
    return linear(x, self.weight, self.bias)


class _SplitNF4Linear(torch.autograd.Function):
    """``x @ W.T`` for a frozen ``DTensor`` W of an ``NF4Tensor``: dequantized when used."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: DTensor) -> torch.Tensor:  # noqa: D102
        ctx.weight = weight  # the packed piece, as torchao's LinearNF4 keeps it
        return F.linear(x, dequantize(weight).to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad @ dequantize(ctx.weight).to(grad.dtype), None


def frozen_linear_bytes(model: nn.Module) -> int:
    """Bytes this rank holds for the weights ``quantize_base_nf4`` may quantize.

    Those are the frozen weights of linear layers other than ``lm_head`` (and the adapters'
    own) and the frozen stacked MoE expert weights; an NF4 weight counts its packed values,
    block scales and scale factors.

    Args:
        model: A model, sharded or not.

    Returns:
        The bytes of this rank's shards of those weights.
    """
    total = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        leaf = name.rpartition(".")[2]
        if isinstance(module, MoEExperts):
            weights = [module.gate_up_proj, module.down_proj]
        elif _is_linear(module) and leaf not in (*_OUTPUT_LAYERS, "lora_A", "lora_B"):
            weights = [weight]
        else:
            continue
        for weight in weights:
            if weight is None or weight.requires_grad:
                continue
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            if is_nf4(local):
                inner = (local.quantized_data, local.quantized_scalers, local.quantization_factor)
                total += sum(t.numel() * t.element_size() for t in inner)
            else:
                total += local.numel() * local.element_size()
    return total
