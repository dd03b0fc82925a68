"""The data-parallel device mesh: plain FSDP (1-D) or HSDP (2-D, replicate x shard).

FSDP2 shards every parameter over all ranks by default, so each all-gather and
reduce-scatter crosses every link of the job, the slow one between nodes included. HSDP
(hybrid sharding) shards within a group of ``shard_size`` ranks and replicates across
``replicate_size`` such groups: parameters are gathered inside a node, and only the gradient
all-reduce between replicas crosses nodes. ``fully_shard`` does this when given a 2-D mesh whose
dimensions are ``(replicate, shard)``; parameters become DTensors placed
``(Replicate(), Shard(0))``.

torchrun numbers ranks node by node (``node_rank * nproc_per_node + local_rank``), and the mesh
is laid out row-major, so with ``shard_size == nproc_per_node`` each shard group is one node.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tunelab.errors import ConfigError

REPLICATE_DIM = "replicate"
"""Name of the mesh dimension across which parameters are replicated (across nodes)."""
SHARD_DIM = "shard"
"""Name of the mesh dimension across which parameters are sharded (within a node)."""


def data_parallel_mesh(
    device: torch.device, *, replicate_size: int = 1, shard_size: int | None = None
) -> DeviceMesh | None:
    """The mesh ``shard_model`` shards over, from the two data-parallel sizes.

    Args:
        device: This process's device (its type names the mesh's device type).
        replicate_size: Number of replicas (``data_parallel_replicate_size``).
        shard_size: Ranks each parameter is sharded over (``data_parallel_shard_size``);
            None: the world size divided by ``replicate_size``.

    Returns:
        None for plain FSDP over every rank (``replicate_size`` 1, the default: FSDP2 builds
        its own 1-D mesh) or without a process group; otherwise a 2-D mesh with dimensions
        ``("replicate", "shard")``.

    Raises:
        ConfigError: The sizes do not multiply to the world size.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if shard_size is None:
        if world_size % replicate_size:
            raise ConfigError(
                f"data_parallel_replicate_size: {replicate_size} does not divide the "
                f"{world_size} processes of this run"
            )
        shard_size = world_size // replicate_size
    if replicate_size * shard_size != world_size:
        raise ConfigError(
            f"data_parallel_replicate_size x data_parallel_shard_size = {replicate_size} x "
            f"{shard_size} = {replicate_size * shard_size}, but this run has {world_size} "
            "processes: the product must equal the number of processes"
        )
    if replicate_size == 1 or not dist.is_initialized():
        return None
    return init_device_mesh(
        device.type, (replicate_size, shard_size), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM)
    )
