"""The global gradient norm, and clipping to it, over parameters on several device meshes.

``torch.nn.utils.clip_grad_norm_`` stacks every gradient's norm into one tensor, and DTensors
on different meshes cannot be stacked (torch 2.13: "DTensor does not support cross-mesh
operation"). Expert parallelism over groups smaller than the world puts the experts on a
``(replicate, ep)`` mesh and leaves the other weights on FSDP2's 1-D mesh of every process
(``tunelab.distributed.expert_parallel``): the 2-norm of each mesh's gradients is then
computed on its own, made a full (plain) value, and the norms combine as
``sqrt(sum_m norm_m^2)``; each mesh's gradients are scaled by the same coefficient
(torchtitan clips its expert-parallel runs the same way).
"""

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``params`` to a global 2-norm of ``max_norm``, in place.

    Parameters all on one mesh (or plain) take ``torch.nn.utils.clip_grad_norm_`` itself.

    Args:
        params: The parameters; those without a gradient are left out.
        max_norm: The largest global norm (``math.inf``: measure only).

    Returns:
        The global norm before clipping: a DTensor or a plain scalar tensor.
    """
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for param in params:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh[mesh].append(param)
    if len(by_mesh) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([param.grad for param in group], 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    for group in by_mesh.values():  # one mesh at a time: a foreach op takes one mesh
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
