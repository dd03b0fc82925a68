"""FSDP2 wrapping and activation checkpointing.

Each transformer block is sharded with ``fully_shard``, then the root, so parameters become
``DTensor`` with ``Shard(0)`` placements. World size 1 skips FSDP, unless mixed precision asks
for its bf16 casting.
"""

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from tunelab._torch_compat import checkpoint_activations
from tunelab.errors import ConfigError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """Map a config dtype name (``fp32``, ``bf16``, ``fp16``) to a torch dtype."""
    return _DTYPES[name]


def shard_model(
    model: nn.Module,
    *,
    reshard_after_forward: bool = True,
    mixed_precision: bool = False,
    mesh: DeviceMesh | None = None,
    frozen_base: Literal["shard", "replicate"] = "shard",
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard a model with FSDP2: each transformer block, then the root.

    Args:
        model: A decoder exposing ``model.layers`` (its transformer blocks).
        reshard_after_forward: Free the unsharded parameters after each block's forward
            (less memory, one more all-gather in backward).
        mixed_precision: Compute in bf16 with fp32 gradient reduction (parameters stay
            in their own dtype). FSDP2 does the casting, so one process is wrapped too, on a
            mesh of one rank: its losses then follow those of N processes in bf16 (measured
            on the tiny model: within 5e-7 at the first step, 3e-5 at the second).
        mesh: The data-parallel mesh (``data_parallel_mesh``): a 2-D ``(replicate, shard)``
            mesh shards within each replica group and replicates across them (HSDP); None
            shards over every rank.
        frozen_base: ``replicate``: the submodules holding trainable parameters (the
            adapters) form FSDP2 groups of their own, and the frozen weights of each block
            and of the root are gathered at the first forward and then kept gathered (never
            resharded), so later steps all-gather and reduce-scatter only the adapters. Each
            rank then holds the full frozen base plus its shard (what checkpoints, the merge
            and exports read, unchanged). ``shard``: gathered for every forward and backward,
            the next block prefetched while one computes.
        ignored_params: Parameters FSDP2 leaves as they are (expert-parallel experts, already
            split over ``mesh``: ``tunelab.distributed.expert_parallel``).

    Returns:
        The same module, sharded in place. Unchanged on one process without mixed precision.

    Raises:
        ConfigError: ``mixed_precision`` without a process group (a recipe started by hand,
            not by ``tunelab run`` or torchrun).
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size == 1 and not mixed_precision:
        return model
    if not dist.is_initialized():
        raise ConfigError(
            "mixed_precision: true needs a process group, since FSDP2 does the bf16 casting: "
            "launch the recipe with `tunelab run` (or torchrun)"
        )
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    shard = partial(fully_shard, mesh=mesh, mp_policy=mp_policy, ignored_params=ignored_params)
    replicate = frozen_base == "replicate"
    if replicate:
        _shard_trainable(model, shard)
    blocks = list(model.layers)
    for index, block in enumerate(blocks):
        # The last block's backward comes first: keep it gathered from forward to backward.
        last = index == len(blocks) - 1
        shard(block, reshard_after_forward=reshard_after_forward and not last and not replicate)
        if replicate:
            block.set_reshard_after_backward(False, recurse=False)
    # The root (embedding, final norm, lm_head) stays gathered from forward to backward: its
    # backward comes next, and a chunked loss calls lm_head after the model's forward.
    shard(model, reshard_after_forward=False)
    if replicate:
        model.set_reshard_after_backward(False, recurse=False)
    else:
        # Gather the next block while this one computes (and the previous one in backward).
        for block, following in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([block])
    return model


def _shard_trainable(model: nn.Module, shard: Callable) -> None:
    # One FSDP2 group for every submodule that holds trainable parameters (the adapters):
    # gathered once per step at the first forward and kept until the end of the backward,
    # their gradients reduce-scattered once per step. The frozen weights, in the groups of
    # the blocks and the root around them, can then stay gathered.
    holders = [
        module
        for module in model.modules()
        if any(param.requires_grad for param in module.parameters(recurse=False))
    ]
    if holders:
        shard(holders, reshard_after_forward=False)


ACTIVATION_CHECKPOINTING_SCOPES = ("block", "attention")
"""The values of ``activation_checkpointing_scope``."""


def apply_activation_checkpointing(
    model: nn.Module, *, every: int = 1, scope: Literal["block", "attention"] = "block"
) -> None:
    """Recompute transformer blocks' activations in backward (selectively).

    Blocks ``0, every, 2 * every, ...`` are checkpointed: ``every`` 1 recomputes each block
    (least memory, one more forward of the model), ``every`` k about ``1 / k`` of them (the
    others keep their activations: less recompute, more memory). ``scope`` picks what is
    recomputed in a checkpointed block: the whole ``block``, which keeps only its input, or
    only its ``attention`` (``self_attn``: its projections, rotary and the attention itself),
    whose activations grow with the heads and, under a dense mask, with the square of the
    sequence; the feed-forward's are kept.

    Uses the composable ``checkpoint``, which, unlike ``checkpoint_wrapper``, keeps
    parameter names unchanged (no ``_checkpoint_wrapped_module.`` prefix in checkpoints).

    Args:
        model: A decoder exposing ``model.layers``.
        every: Checkpoint one block in ``every``.
        scope: ``block`` or ``attention``.

    Raises:
        ConfigError: ``every`` below 1 or an unknown scope.
    """
    if every < 1:
        raise ConfigError(f"activation_checkpointing_every must be at least 1, got {every}")
    if scope not in ACTIVATION_CHECKPOINTING_SCOPES:
        raise ConfigError(
            f"activation_checkpointing_scope must be one of {ACTIVATION_CHECKPOINTING_SCOPES}, "
            f"got {scope!r}"
        )
    for index, block in enumerate(model.layers):
        if index % every == 0:
            checkpoint_activations(block if scope == "block" else block.self_attn)


def reshard(model: nn.Module) -> None:
    """Reshard an FSDP2 root whose forward ran under ``no_grad``.

    After such a forward the root keeps unsharded parameters; editing sharded parameters
    in place (loading a checkpoint) without resharding leaves the next forward stale.
    """
    reshard_fn = getattr(model, "reshard", None)
    if reshard_fn is not None:
        reshard_fn()


@contextlib.contextmanager
def hold_gathered(model: nn.Module, *, gather_now: bool = False) -> Iterator[None]:
    """Keep each FSDP2 group of ``model`` gathered from its first forward until the block ends.

    For many forwards in a row with no update between them (generation: one forward per
    token): each group is all-gathered once, at the first forward that needs it, instead of
    once per forward. Every rank then holds the whole model (in the compute dtype) until the
    block ends, on top of its shards. On exit each group's own ``reshard_after_forward`` comes
    back, and the groups that have it are resharded, so the state after the block is the one a
    single forward leaves. A plain module: nothing to do.

    Args:
        model: The model, FSDP2-sharded or plain.
        gather_now: All-gather every group on entry (in module order, the same on every
            rank), so the module attributes are the whole tensors before any forward (to
            build something from them, as ``tunelab.peft.merged_adapters`` does). Only for
            an FSDP2 root; otherwise the groups gather at their first forward.
    """
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    settings = [_reshards_after_forward(module) for module in modules]
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        if gather_now and isinstance(model, FSDPModule):
            # FSDP2 sets up its communication state at the root's first forward; an unshard
            # before any forward needs it first (idempotent; torch 2.13 FSDPState._lazy_init).
            model._get_fsdp_state()._lazy_init()
            for module in modules:
                module.unshard()
        yield
    finally:
        for module, setting in zip(modules, settings, strict=True):
            module.set_reshard_after_forward(setting, recurse=False)
            if setting:
                module.reshard()


def _reshards_after_forward(module: FSDPModule) -> bool:
    # FSDP2 has a setter for reshard_after_forward but no getter: a group reshards after its
    # forward exactly when it has a post-forward mesh (torch 2.13 FSDPParamGroup).
    groups = module._get_fsdp_state()._fsdp_param_groups
    return any(group.post_forward_mesh_info is not None for group in groups)
