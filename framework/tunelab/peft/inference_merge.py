"""Adapters merged into temporary weights for a run of inference-only forwards (rollouts).

Generation runs one forward per token; on a small model each ``LoRALinear`` then costs three
matmuls and their per-call overhead (``x W^T``, ``x A^T``, ``(x A^T) B^T``) instead of one. Inside
:func:`merged_adapters` each adapted layer computes ``F.linear(x, W', b)`` with

    W' = W + scale * B A                                    (LoRA)
    W' = m / ||W + scale * B A||_row * (W + scale * B A)    (DoRA)

built once on entry by the export's merge (:func:`tunelab.peft.merge.merge_weight`: fp32, cast to
the weight's dtype) into a new tensor, and dropped on exit. The live parameters are never written.

The merged forward equals the adapted one up to rounding (the update is added to the weight
instead of to the output): sampled tokens may differ from the unmerged path's where two tokens
are nearly tied, and are the tokens the merged export would sample. The merge is deterministic,
so a run and its resume sample the same tokens.

Layers left on the unmerged path (each computes exactly as without the block):

- an NF4 base (QLoRA): ``W'`` would be a full-precision copy of the weight that QLoRA keeps in
  4 bits (an 8B model's linear weights are about 14 GB in bf16);
- a weight that is still a sharded ``DTensor`` (FSDP2 gathers it per forward): merging would
  take its own all-gather; gather first (:func:`tunelab.distributed.hold_gathered` with
  ``gather_now``);
- a disabled adapter, and adapter dropout in training mode (the merged form has no dropout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tunelab.peft.lora import LoRALinear
from tunelab.peft.merge import merge_weight
from tunelab.peft.nf4 import is_nf4

__all__ = ["merged_adapters"]


def _mergeable(module: LoRALinear) -> bool:
    tensors = [module.weight, module.lora_A.weight, module.lora_B.weight]
    if module.lora_magnitude_vector is not None:
        tensors.append(module.lora_magnitude_vector)
    dropout_active = module.training and not isinstance(module.dropout, nn.Identity)
    return not (
        module.disabled
        or dropout_active
        or is_nf4(module.weight)
        or any(isinstance(tensor, DTensor) for tensor in tensors)
    )


@contextlib.contextmanager
def merged_adapters(model: nn.Module) -> Iterator[int]:
    """Run ``model``'s ``LoRALinear`` layers with merged weights inside the ``with`` block.

    For forwards with no update between them (a rollout phase). The merged weights cost one
    more copy of each adapted weight (in its dtype) for the duration of the block. Weights and
    adapters must not change inside it: the merged copies would not follow.

    Args:
        model: A model, LoRA-applied or not (then nothing happens).

    Yields:
        The number of layers merged (the others run unmerged; see the module docstring).
    """
    merged: list[LoRALinear] = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, LoRALinear) and _mergeable(module):
                    module.merged_weight = merge_weight(
                        module.weight,
                        module.lora_A.weight,
                        module.lora_B.weight,
                        module.scale,
                        module.lora_magnitude_vector,
                    )
                    merged.append(module)
        yield len(merged)
    finally:
        for module in merged:
            module.merged_weight = None
