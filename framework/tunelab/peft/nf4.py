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
weight stays in the training dtype. :func:`dequantize_experts` gives the ``[E, rows, cols]``
values back (a merge adds each rank's own experts' updates to them).

The model is quantized on the meta device, before ``fully_shard``: FSDP2 then shards the
``NF4Tensor`` by rows, ``to_empty`` allocates the packed shards, and the loader fills them with
:func:`copy_rows_nf4_`. On an HSDP mesh whose shard groups have one rank (``replicate x 1``),
FSDP2 copies instead of gathering, and ``_nf4_fsdp`` adapts torchao's hooks to that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

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
        return DTensor.from_local(
            local.get_original_weight(),
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    return tensor.get_original_weight() if is_nf4(tensor) else tensor


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
        reason = _why_not_quantizable(weight.shape[0], weight.shape[1], world_size)
        if name.startswith(vision):
            reason = "the vision tower or projector: QLoRA quantizes the language model only"
        elif isinstance(module, MoERouter):
            reason = "an MoE router: its few weights decide the routing"
        if reason is not None:
            plan.kept[name] = reason
            continue
        module.weight = _empty_nf4(weight, to_nf4, tables, device)
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
) -> nn.Parameter:
    """The frozen NF4 parameter of a 2-D meta weight (its values come at load)."""
    quantized = to_nf4(weight.detach(), NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE)
    # The two tensors FSDP2 does not shard are shared by every row shard: make them real
    # now, so that to_empty (which allocates only the sharded ones) leaves none on meta.
    if weight.dtype not in tables:
        tables[weight.dtype] = _nf4_levels(to_nf4, weight.dtype, device)
    quantized.nf4 = tables[weight.dtype]
    quantized.scaler_mean = torch.zeros((), dtype=weight.dtype, device=device)
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
        num_experts, rows, cols = weight.shape
        if num_experts % world_size:
            plan.kept[fqn] = (
                f"{num_experts} experts do not split evenly over {world_size} processes"
            )
            continue
        reason = _why_not_quantizable(num_experts * rows, cols, world_size)
        if reason is not None:
            plan.kept[fqn] = reason
            continue
        packed = weight.detach().reshape(num_experts * rows, cols)
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
    # The mesh dimension that shards the rows (HSDP's 2-D mesh also has a replicating one).
    for dim, placement in enumerate(param.placements):
        if placement.is_shard(0) and param.device_mesh.size(dim) > 1:
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
    scaler_mean = _scaler_mean(rows, param)
    scalers, factor, data = quantize_rows_nf4(rows, scaler_mean, local.nf4)
    local.quantized_scalers.copy_(scalers)
    local.quantization_factor.copy_(factor)
    local.quantized_data.copy_(data)
    local.scaler_mean.copy_(scaler_mean)


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
