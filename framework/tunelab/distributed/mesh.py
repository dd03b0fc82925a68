"""The data-parallel device mesh: plain FSDP (1-D) or HSDP (2-D, replicate x shard).

With context parallelism the cp ranks join the shard dimension (``data_parallel_mesh``).

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

from tunelab.config.sections import ParallelismArgs
from tunelab.errors import ConfigError

REPLICATE_DIM = "replicate"
"""Name of the mesh dimension across which parameters are replicated (across nodes)."""
SHARD_DIM = "shard"
"""Name of the mesh dimension across which parameters are sharded (within a node)."""


def data_parallel_mesh(
    device: torch.device, parallelism: ParallelismArgs | None = None
) -> DeviceMesh | None:
    """The mesh ``shard_model`` shards over, from the data- and context-parallel sizes.

    The job is ``replicate x shard x context_parallel`` processes, context parallelism
    innermost (``tunelab.distributed.context_parallel``). The ranks of a cp group compute
    gradients of the same parameters from different tokens of the same samples, so FSDP2
    shards each parameter over the shard and cp ranks together (``shard_size *
    context_parallel_size`` ranks, torchtitan's ``dp_shard_cp``) and its reduction sums over
    them.

    Args:
        device: This process's device (its type names the mesh's device type).
        parallelism: The ``parallelism`` settings, taken whole: ``data_parallel_replicate_size``
            (replicas), ``data_parallel_shard_size`` (ranks each parameter is sharded over;
            None: the world size divided by the replicas and ``context_parallel_size``) and
            ``context_parallel_size`` (ranks that split each sequence; 1 in the recipes whose
            section has no such setting). None: the defaults (plain FSDP).

    Returns:
        None for plain FSDP over every rank (``replicate_size`` 1, the default: FSDP2 builds
        its own 1-D mesh) or without a process group; otherwise a 2-D mesh with dimensions
        ``("replicate", "shard")``, the second of ``shard_size * context_parallel_size`` ranks.

    Raises:
        ConfigError: The sizes do not multiply to the world size.
    """
    parallelism = parallelism if parallelism is not None else ParallelismArgs()
    replicate_size = parallelism.data_parallel_replicate_size
    shard_size = parallelism.data_parallel_shard_size
    cp = parallelism.context_parallel_size
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if shard_size is None:
        if world_size % (replicate_size * cp):
            what = (
                f"parallelism.data_parallel_replicate_size: {replicate_size}"
                if cp == 1
                else f"parallelism.data_parallel_replicate_size x parallelism.context_parallel_size = "
                f"{replicate_size} x {cp}"
            )
            raise ConfigError(f"{what} does not divide the {world_size} processes of this run")
        shard_size = world_size // (replicate_size * cp)
    if replicate_size * shard_size * cp != world_size:
        sizes = (
            f"parallelism.data_parallel_replicate_size x parallelism.data_parallel_shard_size = "
            f"{replicate_size} x "
            f"{shard_size} = {replicate_size * shard_size}"
            if cp == 1
            else "parallelism.data_parallel_replicate_size x parallelism.data_parallel_shard_size x "
            f"parallelism.context_parallel_size = {replicate_size} x {shard_size} x {cp} = "
            f"{replicate_size * shard_size * cp}"
        )
        raise ConfigError(
            f"{sizes}, but this run has {world_size} processes: the product must equal the "
            "number of processes"
        )
    if replicate_size == 1 or not dist.is_initialized():
        return None
    return init_device_mesh(
        device.type, (replicate_size, shard_size * cp), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM)
    )
