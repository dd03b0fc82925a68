"""Column-wise tensor parallelism of a fused projection (Phi-3's ``qkv_proj``, ``gate_up_proj``).

A fused projection's rows are its parts one after the other (q, k, v; gate, up). Under tensor
parallelism over N ranks, what follows it needs rank ``r`` to hold the ``r``-th slice of every
part's output (``[q_r, k_r, v_r]``: its query heads and the key/value heads they read;
``[gate_r, up_r]``), not the ``r``-th contiguous block of the fused output, which holds whole
parts of one kind.

The parameters are split as any column-wise weight's: ``Shard(0)`` over the fused rows in the
checkpoint's order, LoRA's ``A`` replicated and ``B`` split like the base's rows, DoRA's
magnitude like the rows. So step checkpoints, DCP's resharding to other layouts, the merged
export (each rank's rows one byte range) and the PEFT adapter read them exactly as they read
a plain run's, and the module runs unchanged (``nn.Linear`` or ``tunelab.peft.LoRALinear``:
dropout, DoRA and NF4 pieces included). Its local output, this rank's block of the fused
features, is then regrouped per part by one ``all_to_all`` over the tp ranks, whose backward
is the reverse exchange; values only move, so the result is exact.

The cost is that exchange: the features a rank computes for another, ``tokens x rows / N``
values at most, a third of them for ``qkv_proj`` at N = 2 when q, k and v are as wide
(Phi-3-mini) and half for ``gate_up_proj``. Storing the rows regrouped instead would need the
checkpoints, exports and DCP's resharding to undo a permutation no ``DTensor`` placement
expresses.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from tunelab.distributed.collectives import all_to_all_rows


class FusedColwise(ParallelStyle):
    """Split a fused projection per part over the tp ranks (see the module docstring).

    Args:
        part_sizes: the parts' rows in the fused order (``[q, k, v]`` or ``[gate, up]``),
            each a multiple of the tp size.
        colwise: the style splitting the module's rows as any column-wise weight's
            (``ColwiseParallel``, or its LoRA form), whose local output this one regroups.
    """

    def __init__(self, part_sizes: list[int], colwise: ParallelStyle) -> None:
        super().__init__()
        self.part_sizes = list(part_sizes)
        self.colwise = colwise

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.colwise._apply(module, device_mesh)
        plan = _regroup_plan(self.part_sizes, device_mesh.size(), device_mesh.get_local_rank())
        group = device_mesh.get_group()

        def regroup(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
            # [..., features] with the features to exchange first: one row per feature.
            if plan["index"].device != output.device:
                plan["index"] = plan["index"].to(output.device)  # once, not per forward
            rows = output.movedim(-1, 0).index_select(0, plan["index"])
            rows = all_to_all_rows(rows, plan["send_splits"], plan["receive_splits"], group)
            return rows.movedim(0, -1)

        # After the colwise style's own hook (the local output of this rank's rows).
        module.register_forward_hook(regroup)
        return module


def _regroup_plan(part_sizes: list[int], size: int, rank: int) -> dict[str, Any]:
    """Which of this rank's stored rows go to which rank, and how many come from each.

    Rank ``s`` computes the fused rows ``T_s`` (its slice of each part, in increasing order).
    Rank ``r`` stores the rows ``[r B, (r + 1) B)``, ``B = rows / size``. It sends to ``s``
    its rows in ``T_s``, in order; ``s`` receives them by sender, which is ``T_s``'s order
    too (``T_s`` increases and each sender's rows come before the next sender's).
    """
    block = sum(part_sizes) // size
    targets = []
    for target in range(size):
        rows, offset = [], 0
        for part in part_sizes:
            piece = part // size
            rows.append(torch.arange(offset + target * piece, offset + (target + 1) * piece))
            offset += part
        targets.append(torch.cat(rows))
    send_index, send_splits = [], []
    for rows in targets:
        mine = rows[(rows >= rank * block) & (rows < (rank + 1) * block)] - rank * block
        send_index.append(mine)
        send_splits.append(len(mine))
    own = targets[rank] // block
    receive_splits = [int((own == sender).sum()) for sender in range(size)]
    return {
        "index": torch.cat(send_index),
        "send_splits": send_splits,
        "receive_splits": receive_splits,
    }
