"""FSDP2's all-gather of an NF4 weight over a shard group of one rank (HSDP ``(R, 1)``).

torchao's ``NF4Tensor.fsdp_pre_all_gather`` hands FSDP2 three tensors to gather (block scales,
scale factors, packed values). When the shard group has one rank (a ``(replicate, 1)`` mesh:
every rank holds whole weights, replicated), torch 2.13's FSDP2 skips the all-gather and copies
only the first of them (``FSDPParamGroup.wait_for_unshard``), so torchao's
``fsdp_post_all_gather`` gets one tensor and fails at the first forward ("not enough values to
unpack (expected 3, got 1)").

:func:`gather_one_tensor_on_one_rank` wraps both hooks once: on a group of one rank the packed
values are the one tensor FSDP2 copies, and the block scales and factors, which are the whole
weight's already, travel in the metadata; on larger groups torchao's hooks run unchanged.
Under tensor parallelism FSDP2's later gathers pass its unsharded ``DTensor`` as ``out``, where
torchao expects the ``NF4Tensor`` inside it: the wrapper hands over that one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class _OneRankGather:
    """Metadata of an NF4 "all-gather" over one rank: what FSDP2 does not copy, and torchao's."""

    quantized_scalers: torch.Tensor
    quantization_factor: torch.Tensor
    torchao_metadata: Any


def gather_one_tensor_on_one_rank(nf4_tensor: type) -> None:
    """Make ``nf4_tensor``'s FSDP2 hooks hand over one tensor when the shard group has one rank.

    Idempotent; torchao's hooks keep running for groups of more than one rank.

    Args:
        nf4_tensor: torchao's ``NF4Tensor`` class (patched in place).
    """
    if getattr(nf4_tensor, "_tunelab_one_rank_gather", False):
        return
    torchao_pre = nf4_tensor.fsdp_pre_all_gather
    torchao_post = nf4_tensor.fsdp_post_all_gather

    # FSDP2 reads the signature: one parameter after self (torchao's is the same).
    def fsdp_pre_all_gather(self, mesh):
        inputs, metadata = torchao_pre(self, mesh)
        if mesh.get_group().size() > 1:
            return inputs, metadata
        quantized_scalers, quantization_factor, quantized_data = inputs
        return (quantized_data,), _OneRankGather(quantized_scalers, quantization_factor, metadata)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if isinstance(out, DTensor):
            # Tensor parallelism: FSDP2 hands over its unsharded DTensor; the NF4 piece inside
            # is what the gather refilled.
            out = out.to_local()
        if not isinstance(metadata, _OneRankGather):
            return torchao_post(self, all_gather_outputs, metadata, param_dtype, out=out)
        (quantized_data,) = all_gather_outputs
        if out is not None:
            # FSDP2 re-filled the storage of ``out.quantized_data`` in place; the scales are
            # this rank's own, never freed.
            assert out.quantized_data.untyped_storage().data_ptr() == (
                quantized_data.untyped_storage().data_ptr()
            ), "expects out's packed values to be the all-gather output"
            return None
        outputs = (metadata.quantized_scalers, metadata.quantization_factor, quantized_data)
        unsharded, _ = torchao_post(self, outputs, metadata.torchao_metadata, param_dtype)
        # Only the copied tensor is FSDP2's to free at reshard: the scales are the shard's.
        return unsharded, (quantized_data,)

    nf4_tensor.fsdp_pre_all_gather = fsdp_pre_all_gather
    nf4_tensor.fsdp_post_all_gather = fsdp_post_all_gather
    nf4_tensor._tunelab_one_rank_gather = True
