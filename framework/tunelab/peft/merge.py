"""Merge LoRA adapters into their base weights, shard-locally and out of place.

For each ``LoRALinear`` the merged weight is

    W' = W + scale * B A        (scale = alpha / r, or alpha / sqrt(r) with rsLoRA)

computed in fp32 and cast back to the base dtype (a bf16 base would otherwise round the
update before adding it). Under FSDP2 ``W`` and ``B`` are ``Shard(0)`` DTensors sharded
alike, and row ``i`` of ``W'`` needs only row ``i`` of ``W``, row ``i`` of ``B`` and all of
``A``; so each rank merges its own rows with the gathered, small ``A`` (``r x in_dim``) and no
rank ever holds a whole base weight.

DoRA scales each merged row by its magnitude over its norm,

    W' = m / ||W + scale * B A||_row * (W + scale * B A)

and a row's norm needs only that row: a ``Shard(0)`` slice holds whole output rows (all
``in_dim`` columns of each), so each rank computes its own rows' norms and the merge stays
shard-local (``m`` is ``Shard(0)`` like ``B``). An NF4 base (QLoRA) is dequantized shard by
shard first: the merged model is the dequantized base plus the adapter. Frozen NF4 weights
without an adapter are dequantized the same way.

A stacked expert weight with an ``ExpertLoRA`` merges expert by expert,
``W_e' = W_e + scale * B_e A_e`` (transposed for gpt-oss's ``[E, in, out]``). FSDP2 shards it
``Shard(0)`` over experts, so each rank adds the updates of its own experts, computed from the
gathered (small) factors: the merge stays shard-local. Under QLoRA the stacked weight is NF4,
packed 2-D ``[E * rows, cols]``: each rank dequantizes its own experts first
(``dequantize_experts``), as a dense NF4 base is dequantized shard by shard. These weights are merged when the state
dict is built, not deferred to the writer: the export writes them as per-expert hub tensors.

The merge never writes the live parameters: FSDP2's ``model.state_dict()`` aliases them, and
merging into it in place would silently turn training weights into ``W + ΔW`` at each export.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tunelab.distributed._fqn import clean_fqn
from tunelab.errors import TunelabError
from tunelab.modules.moe import MoEExperts
from tunelab.peft._names import MAGNITUDE
from tunelab.peft.apply import expert_weight_fqn, lora_modules
from tunelab.peft.expert_lora import ExpertLoRA, expert_delta
from tunelab.peft.nf4 import dequantize, dequantize_experts, is_nf4, placed_like


def _rows_are_local(weight: DTensor, lora_b: torch.Tensor) -> bool:
    """Whether each rank's rows of ``weight`` and ``lora_b`` are the same rows."""
    return (
        isinstance(lora_b, DTensor)
        and lora_b.device_mesh == weight.device_mesh
        and tuple(lora_b.placements) == tuple(weight.placements)
        and all(p == Shard(0) or isinstance(p, Replicate) for p in weight.placements)
    )


def _merge_plain(
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    if isinstance(weight, DTensor):
        # DTensor in-place ops need matching placements; let DTensor plan this one.
        merged = weight.to(torch.float32) + scale * (
            lora_b.to(torch.float32) @ lora_a.to(torch.float32)
        )
        if magnitude is not None:
            norm = torch.linalg.norm(merged, dim=1)
            merged = merged * (magnitude.to(torch.float32) / norm).unsqueeze(1)
        return merged.to(weight.dtype)
    # One new fp32 buffer, updated in place: bit for bit ``W.float() + scale * (B @ A)``
    # (the same three roundings; + and * commute), without the two temporaries of the
    # out-of-place form, whose fresh pages cost more than the arithmetic here. The base is
    # upcast on the fly by ``add_`` (exact), never copied; a tensor subclass (NF4)
    # dequantizes first.
    merged = torch.mm(lora_b.to(torch.float32), lora_a.to(torch.float32))
    merged.mul_(scale)
    merged.add_(weight if type(weight) is torch.Tensor else weight.to(torch.float32))
    if magnitude is not None:
        # Row norms of this tensor's rows only: the rows of a Shard(0) slice are whole rows.
        norm = torch.linalg.norm(merged, dim=1)
        merged.mul_((magnitude.to(torch.float32) / norm).unsqueeze(1))
    return merged if weight.dtype == torch.float32 else merged.to(weight.dtype)


def merge_weight(
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    """``weight + scale * lora_b @ lora_a`` in fp32, cast to ``weight.dtype``, in a new tensor.

    With a DoRA ``magnitude`` each row is then scaled by ``magnitude / ||row||``.

    Collective when the inputs are DTensors (``lora_a`` is gathered): call on every rank.

    Args:
        weight: Base weight ``[out_dim, in_dim]``, plain or a DTensor.
        lora_a: Adapter ``A`` ``[rank, in_dim]``, plain or a DTensor.
        lora_b: Adapter ``B`` ``[out_dim, rank]``, sharded like ``weight``.
        scale: The LoRA scale.
        magnitude: DoRA's magnitude ``[out_dim]``, sharded like ``lora_b``; None for LoRA.

    Returns:
        The merged weight; for a DTensor ``weight`` a DTensor with its mesh, placements,
        shape and stride, built from this rank's rows only.
    """
    if not isinstance(weight, DTensor):
        return _merge_plain(weight, lora_a, lora_b, scale, magnitude)
    if _rows_are_local(weight, lora_b) and (
        magnitude is None or _rows_are_local(weight, magnitude)
    ):
        lora_a_full = lora_a.full_tensor() if isinstance(lora_a, DTensor) else lora_a
        local_magnitude = None if magnitude is None else magnitude.to_local()
        local = _merge_plain(
            weight.to_local(), lora_a_full, lora_b.to_local(), scale, local_magnitude
        )
        return placed_like(weight, local)
    if magnitude is None and (type(weight.to_local()) is torch.Tensor or is_nf4(weight)):
        # Other layouts (tensor parallel: a block of rows and columns per rank): the small
        # factors whole, and this rank's block W[r0:r1, c0:c1] + scale * B[r0:r1] A[:, c0:c1]
        # (an NF4 block dequantized on the way).
        (rows, cols), (row0, col0) = compute_local_shape_and_global_offset(
            weight.shape, weight.device_mesh, weight.placements
        )
        lora_a, lora_b = (
            t.full_tensor() if isinstance(t, DTensor) else t for t in (lora_a, lora_b)
        )
        local = _merge_plain(
            weight.to_local(),
            lora_a[:, col0 : col0 + cols],
            lora_b[row0 : row0 + rows],
            scale,
        )
        return placed_like(weight, local)
    # Others (DoRA): let DTensor plan the communication (a DoRA row's
    # norm over the columns of several ranks), then return the base's layout. A factor
    # given whole (the adapter file's A) joins as replicated.
    lora_a, lora_b, magnitude = (
        _replicated_on(weight.device_mesh, t) for t in (lora_a, lora_b, magnitude)
    )
    return _merge_plain(dequantize(weight), lora_a, lora_b, scale, magnitude).redistribute(
        weight.device_mesh, weight.placements
    )


def _replicated_on(mesh: DeviceMesh, tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None or isinstance(tensor, DTensor):
        return tensor
    return DTensor.from_local(tensor, mesh, [Replicate()] * mesh.ndim, run_check=False)


def merge_expert_weight(
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    adapter: ExpertLoRA,
) -> torch.Tensor:
    """A stacked expert weight plus its per-expert LoRA updates, in fp32, cast back.

    Collective when the inputs are DTensors (the factors are gathered): call on every rank.

    Args:
        weight: ``[E, out, in]`` (``[E, in, out]`` when ``transposed``), plain or a DTensor.
        lora_a: ``[E * r, in]``, plain or a DTensor.
        lora_b: ``[out, r * E]``, plain or a DTensor.
        adapter: The ``ExpertLoRA`` (its scale, number of experts and layout).

    Returns:
        The merged weight; for a DTensor ``weight`` sharded over experts a DTensor of the
        same layout, built from this rank's experts only.
    """
    lora_a, lora_b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (lora_a, lora_b))
    transposed = adapter.transposed
    if not isinstance(weight, DTensor):
        delta = expert_delta(
            lora_a, lora_b, adapter.num_experts, adapter.scale, slice(None), transposed
        )
        return (weight.float() + delta).to(weight.dtype)
    if not all(p == Shard(0) or isinstance(p, Replicate) for p in weight.placements):
        full = merge_expert_weight(weight.full_tensor(), lora_a, lora_b, adapter)
        return DTensor.from_local(
            full, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim
        ).redistribute(weight.device_mesh, weight.placements)
    local = weight.to_local()
    shape, offset = compute_local_shape_and_global_offset(
        weight.shape, weight.device_mesh, weight.placements
    )
    experts = slice(offset[0], offset[0] + shape[0])
    delta = expert_delta(lora_a, lora_b, adapter.num_experts, adapter.scale, experts, transposed)
    merged = (local.float() + delta).to(weight.dtype)
    return placed_like(weight, merged)


def _lora_state(
    model: nn.Module, caller: str
) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
    """The LoRA modules and the state dict, both under clean FQNs.

    An ``ExpertLoRA`` is listed under the FQN of the stacked weight it adapts. Stacked expert
    weights are given as ``[E, rows, cols]`` values: NF4-packed ones dequantized (each rank its
    own experts), plain ones as they are.
    """
    modules = {}
    for name, module in lora_modules(model).items():
        name = clean_fqn(name)
        modules[expert_weight_fqn(name) if isinstance(module, ExpertLoRA) else name] = module
    if not modules:
        raise TunelabError(f"{caller}: the model has no LoRA layers; call apply_lora first")
    state = {clean_fqn(key): value for key, value in model.state_dict().items()}
    for name, experts in model.named_modules():
        if isinstance(experts, MoEExperts):
            for projection in ("gate_up_proj", "down_proj"):
                key = clean_fqn(f"{name}.{projection}")
                state[key] = dequantize_experts(state[key], experts.num_experts)
    return modules, state


def _expert_factors(
    key: str,
    state: Mapping[str, torch.Tensor],
    full_adapter: Mapping[str, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    experts, _, projection = key.rpartition(".")
    source = full_adapter or state
    return tuple(source[f"{experts}.lora.{projection}.{f}.weight"] for f in ("lora_A", "lora_B"))


def _role(key: str, modules: Mapping[str, nn.Module]) -> str:
    """The key's role: ``"weight"``, ``"experts"``, ``"adapter"`` or ``"other"``.

    An adapted base weight, an adapted stacked expert weight, a LoRA factor or DoRA magnitude,
    or anything else.
    """
    if isinstance(modules.get(key), ExpertLoRA):
        return "experts"
    owner, _, leaf = key.rpartition(".")
    if owner in modules and leaf == "weight":
        return "weight"
    if owner in modules and leaf == MAGNITUDE:
        return "adapter"
    parent, _, name = owner.rpartition(".")
    if name in ("lora_A", "lora_B") and (parent in modules or expert_weight_fqn(parent) in modules):
        return "adapter"
    return "other"


def merged_state_dict(
    model: nn.Module, full_adapter: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The model's state dict with every LoRA update merged into its base weight.

    Out of place: merged weights are new tensors; all other parameters and buffers are the
    model's own ``state_dict()`` values, not copies (treat them as read-only). Keys are the
    base FQNs (``...q_proj.weight``); no ``lora_A``/``lora_B`` key remains. Under FSDP2 the
    merge is shard-local (see the module docstring) and this is a collective: call it on
    every rank. A tied ``lm_head`` with LoRA gets its own merged ``lm_head.weight``, which no
    longer equals the embedding: export it untied.

    Args:
        model: A LoRA-applied model, sharded or not.
        full_adapter: The adapter already gathered (``adapter_state_dict`` keys, full
            tensors), e.g. for the adapter file; its ``lora_A`` weights are used instead of
            gathering them again.

    Returns:
        ``{fqn: tensor}`` with DTensors where the model's parameters are DTensors.

    Raises:
        TunelabError: If the model has no LoRA layers.
    """
    modules, state = _lora_state(model, "merged_state_dict")
    merged = {}
    for key, value in state.items():
        role = _role(key, modules)
        if role == "weight":
            owner = key.rpartition(".")[0]
            lora_a_key = f"{owner}.lora_A.weight"
            merged[key] = merge_weight(
                value,
                full_adapter[lora_a_key] if full_adapter else state[lora_a_key],
                state[f"{owner}.lora_B.weight"],
                modules[owner].scale,
                state.get(f"{owner}.{MAGNITUDE}"),
            )
        elif role == "experts":
            lora_a, lora_b = _expert_factors(key, state, full_adapter)
            merged[key] = merge_expert_weight(value, lora_a, lora_b, modules[key])
        elif role == "other":
            merged[key] = dequantize(value)
    return merged


def lazy_merged_state_dict(
    model: nn.Module, full_adapter: Mapping[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """``merged_state_dict`` with the merges deferred until each weight is consumed.

    Same keys, shapes and dtypes as ``merged_state_dict``, but each adapted weight whose
    rows are local (FSDP2 ``Shard(0)``, or no sharding) is still the base weight, paired with
    a function that maps this rank's local rows of it to the merged rows, bit for bit what
    ``merged_state_dict`` holds there. A writer that applies the function just before writing
    each weight (``save_hf_sharded(local_transforms=...)``) never holds more than one merged
    weight, and its merge of one weight overlaps the other ranks' writes. Weights in other
    layouts (tensor parallel) are merged now. Collective under FSDP2: call it on every rank.

    Args:
        model: A LoRA-applied model, sharded or not.
        full_adapter: The adapter already gathered (see ``merged_state_dict``).

    Returns:
        The state dict and ``{fqn: merge_local_rows}`` for the deferred weights. Apply a
        function only to this rank's whole local shard of its key (a DCP write chunk).

    Raises:
        TunelabError: If the model has no LoRA layers.
    """
    modules, state = _lora_state(model, "lazy_merged_state_dict")
    result: dict[str, torch.Tensor] = {}
    deferred: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for key, value in state.items():
        role = _role(key, modules)
        if role == "other":
            result[key] = dequantize(value)
        if role == "experts":
            lora_a, lora_b = _expert_factors(key, state, full_adapter)
            result[key] = merge_expert_weight(value, lora_a, lora_b, modules[key])
        if role != "weight":
            continue
        owner = key.rpartition(".")[0]
        lora_a = full_adapter[f"{owner}.lora_A.weight"] if full_adapter else None
        lora_b = state[f"{owner}.lora_B.weight"]
        magnitude = state.get(f"{owner}.{MAGNITUDE}")
        scale = modules[owner].scale
        if isinstance(value, DTensor):
            local = value.to_local()
            # A tensor subclass (NF4) shard takes the eager path: DCP's chunk lookup and
            # planning are only known to work on plain local shards.
            lazy = (
                _rows_are_local(value, lora_b)
                and (magnitude is None or _rows_are_local(value, magnitude))
                and type(local) is torch.Tensor
            )
        else:
            lazy = type(value) is torch.Tensor
        if not lazy:
            a = lora_a if lora_a is not None else state[f"{owner}.lora_A.weight"]
            result[key] = merge_weight(value, a, lora_b, scale, magnitude)
            continue
        if lora_a is None:
            lora_a = state[f"{owner}.lora_A.weight"]
        if isinstance(lora_a, DTensor):
            lora_a = lora_a.full_tensor()
        b_local = lora_b.to_local() if isinstance(lora_b, DTensor) else lora_b
        if isinstance(magnitude, DTensor):
            magnitude = magnitude.to_local()
        result[key] = value
        deferred[key] = functools.partial(
            _merge_rows, lora_a=lora_a, lora_b=b_local, scale=scale, magnitude=magnitude
        )
    return result, deferred


def _merge_rows(
    weight: torch.Tensor,
    *,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    magnitude: torch.Tensor | None,
) -> torch.Tensor:
    assert weight.shape[0] == lora_b.shape[0], "apply to the whole local shard only"
    return _merge_plain(weight, lora_a, lora_b, scale, magnitude)
