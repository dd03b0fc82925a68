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

Tensor parallelism (``tensor_parallel_size`` N > 1) adds the innermost dimension ``"tp"``: N
consecutive ranks (one node's GPUs) split every matmul and see the same samples, and FSDP2
shards over the data-parallel dimensions above it. The world mesh is then
``("replicate", "shard", "tp")`` (``"replicate"`` only with HSDP):

    ranks 0..7, replicate 1 x shard 4 x tp 2:    shard ->
                                        tp   [[0, 1],   <- shard group 0: ranks 0 and 1 hold
                                        |     [2, 3],      the two column halves of q_proj
                                        v     [4, 5],
                                              [6, 7]]   FSDP2 shards each half over 0, 2, 4, 6

With context parallelism too (``context_parallel_size`` C) the ranks are laid out
``(replicate, shard, cp, tp)``: the world mesh is ``("replicate", "shard_cp", "tp")``, FSDP2
sharding over the shard x cp ranks as with cp alone, and its ``"shard_cp"`` dimension is
unflattened into ``("shard", "cp")`` to name the cp groups: the C ranks of one shard group with
the same tp index, ``tensor_parallel_size`` apart (``build_context_parallel``).
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tunelab.config.sections import ParallelismArgs
from tunelab.distributed.expert_parallel import expert_parallel_mesh
from tunelab.errors import ConfigError

REPLICATE_DIM = "replicate"
"""Name of the mesh dimension across which parameters are replicated (across nodes)."""
SHARD_DIM = "shard"
"""Name of the mesh dimension across which parameters are sharded (within a node)."""
TENSOR_DIM = "tp"
"""Name of the (innermost) mesh dimension whose ranks split each matmul (tensor parallelism)."""
CONTEXT_DIM = "cp"
"""Name of the mesh dimension whose ranks split each sequence, next to ``"tp"`` (context
parallelism with tensor parallelism)."""
SHARD_CONTEXT_DIM = "shard_cp"
"""The ``"shard"`` and ``"cp"`` dimensions flattened into one: what FSDP2 shards over when
context and tensor parallelism combine."""
_SETTINGS = {
    REPLICATE_DIM: "data_parallel_replicate_size",
    SHARD_DIM: "data_parallel_shard_size",
    CONTEXT_DIM: "context_parallel_size",
    TENSOR_DIM: "tensor_parallel_size",
}


@dataclass(frozen=True)
class DeviceMeshes:
    """The meshes one run shards over, cut from one world mesh."""

    data_parallel: DeviceMesh | None
    """What FSDP2 shards over (``data_parallel_mesh``); None: FSDP2's own 1-D mesh."""
    tensor: DeviceMesh | None
    """The tensor-parallel ranks (``"tp"``), or None without tensor parallelism."""
    expert: DeviceMesh | None = None
    """The processes each MoE layer's experts are split over (``expert_parallel_mesh``), or
    None without expert parallelism."""
    context: DeviceMesh | None = None
    """With tensor parallelism, the context-parallel ranks (``"cp"``, the ranks holding the
    same tp index: ``build_context_parallel`` takes its group), or None; without tensor
    parallelism cp groups are consecutive ranks and built on their own."""
    whole: bool = False
    """True: no split at all, a whole copy of the model on every process, also in a
    multi-process run (asynchronous GRPO's sampling copy, ``rollout.overlap``); the meshes
    above are then None."""


def data_parallel_mesh(
    device: torch.device, parallelism: ParallelismArgs | None = None
) -> DeviceMesh | None:
    """The mesh ``shard_model`` shards over (``build_device_meshes(...).data_parallel``)."""
    return build_device_meshes(device, parallelism).data_parallel


def build_device_meshes(
    device: torch.device, parallelism: ParallelismArgs | None = None
) -> DeviceMeshes:
    """The meshes of a run, from its data-, context- and tensor-parallel sizes.

    The job is ``replicate x shard x context_parallel x tensor_parallel`` processes, context
    or tensor parallelism innermost (``tunelab.distributed.context_parallel``). The ranks of a cp group compute
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
            section has no such setting), ``tensor_parallel_size`` (ranks that split each
            matmul; likewise) and ``expert_parallel_size`` (ranks each MoE layer's experts are
            split over; likewise). None: the defaults (plain FSDP).

    Returns:
        ``data_parallel``: None for plain FSDP over every rank (``replicate_size`` 1, the
        default: FSDP2 builds its own 1-D mesh) or without a process group; otherwise a 2-D
        mesh with dimensions ``("replicate", "shard")``, the second of ``shard_size *
        context_parallel_size`` ranks; with tensor parallelism the ``"shard"`` mesh (1-D) or
        the ``("replicate", "shard")`` one, cut from the world mesh whose ``"tp"`` dimension
        is ``tensor``; with context parallelism too the world mesh is ``(replicate, shard,
        cp, tp)``, ``data_parallel`` its ``"shard"`` and ``"cp"`` dimensions flattened
        (``"shard_cp"``, after ``"replicate"`` with HSDP) and ``context`` its ``"cp"``
        dimension; ``expert``: the mesh of ``expert_parallel_mesh`` (None: off).

    Raises:
        ConfigError: The sizes do not multiply to the world size, expert parallelism with
            context and tensor parallelism together (not built), or an expert-parallel size
            the run cannot take (``expert_parallel_mesh``).
    """
    parallelism = parallelism if parallelism is not None else ParallelismArgs()
    replicate_size = parallelism.data_parallel_replicate_size
    shard_size = parallelism.data_parallel_shard_size
    cp = parallelism.context_parallel_size
    tp = parallelism.tensor_parallel_size
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if tp > 1 and cp > 1 and parallelism.expert_parallel_size > 1:
        raise ConfigError(
            f"parallelism.expert_parallel_size: {parallelism.expert_parallel_size} with "
            f"parallelism.tensor_parallel_size: {tp} and parallelism.context_parallel_size: "
            f"{cp} is not built yet: drop context or expert parallelism"
        )
    if tp > 1:
        meshes = _tensor_parallel_meshes(device, replicate_size, shard_size, cp, tp, world_size)
    else:
        meshes = DeviceMeshes(
            _data_parallel(device, replicate_size, shard_size, cp, world_size), None
        )
    expert = expert_parallel_mesh(
        parallelism.expert_parallel_size, device, meshes.data_parallel, tensor_parallel_size=tp
    )
    return DeviceMeshes(meshes.data_parallel, meshes.tensor, expert, context=meshes.context)


def _data_parallel(
    device: torch.device, replicate_size: int, shard_size: int | None, cp: int, world_size: int
) -> DeviceMesh | None:
    # Plain FSDP (None: FSDP2's own 1-D mesh) or the (replicate, shard) mesh of HSDP.
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


def _tensor_parallel_meshes(
    device: torch.device,
    replicate_size: int,
    shard_size: int | None,
    cp: int,
    tp: int,
    world_size: int,
) -> DeviceMeshes:
    # The ranks are laid out (replicate, shard, cp, tp), tp innermost, then cp: FSDP2 shards
    # over the dimensions above tp (shard and cp as one, torchtitan's dp_shard_cp), and the
    # tensor-parallel parameters carry both (FSDP2 needs one root mesh).
    def named(sizes: dict[str, int]) -> str:
        used = {name: size for name, size in sizes.items() if name != CONTEXT_DIM or cp > 1}
        keys = " x ".join(f"parallelism.{_SETTINGS[name]}" for name in used)
        return f"{keys} = {' x '.join(str(size) for size in used.values())}"

    if shard_size is None:
        given = {REPLICATE_DIM: replicate_size, CONTEXT_DIM: cp, TENSOR_DIM: tp}
        if world_size % math.prod(given.values()):
            raise ConfigError(
                f"{named(given)} does not divide the {world_size} processes of this run"
            )
        shard_size = world_size // math.prod(given.values())
    sizes = {REPLICATE_DIM: replicate_size, SHARD_DIM: shard_size, CONTEXT_DIM: cp, TENSOR_DIM: tp}  # fmt: skip
    if math.prod(sizes.values()) != world_size:
        raise ConfigError(
            f"{named(sizes)} = {math.prod(sizes.values())}, but this run has {world_size} "
            "processes: the product must equal the number of processes"
        )
    # FSDP2's mesh and the tp one are cut from one world mesh (FSDP2 needs one root); with
    # cp its "shard" dimension holds the shard x cp ranks, unflattened only to name the cp
    # groups: the cp ranks of a shard group compute gradients of the same parameters from
    # different tokens of the same samples, so FSDP2 shards over them too and its
    # reduction sums them.
    replicas = (REPLICATE_DIM,) if replicate_size > 1 else ()
    data = (*replicas, SHARD_DIM if cp == 1 else SHARD_CONTEXT_DIM)
    data_sizes = (*((replicate_size,) if replicas else ()), shard_size * cp)
    world = init_device_mesh(device.type, (*data_sizes, tp), mesh_dim_names=(*data, TENSOR_DIM))
    context = None
    if cp > 1:
        split = world._unflatten(SHARD_CONTEXT_DIM, (shard_size, cp), (SHARD_DIM, CONTEXT_DIM))
        context = split[CONTEXT_DIM]
    return DeviceMeshes(world[data], world[TENSOR_DIM], context=context)
