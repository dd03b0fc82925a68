"""Process groups, FSDP2 wrapping and small collective helpers."""

from tunelab.distributed.collectives import gather_full_tensors
from tunelab.distributed.context_parallel import ContextParallel, build_context_parallel
from tunelab.distributed.fsdp import (
    apply_activation_checkpointing,
    hold_gathered,
    reshard,
    resolve_dtype,
    shard_model,
)
from tunelab.distributed.mesh import DeviceMeshes, build_device_meshes, data_parallel_mesh
from tunelab.distributed.process_group import (
    DistInfo,
    all_reduce_sum,
    collective_timeout,
    destroy_distributed,
    init_distributed,
)

__all__ = [
    "ContextParallel",
    "DeviceMeshes",
    "DistInfo",
    "all_reduce_sum",
    "apply_activation_checkpointing",
    "build_context_parallel",
    "build_device_meshes",
    "collective_timeout",
    "data_parallel_mesh",
    "destroy_distributed",
    "gather_full_tensors",
    "hold_gathered",
    "init_distributed",
    "reshard",
    "resolve_dtype",
    "shard_model",
]
