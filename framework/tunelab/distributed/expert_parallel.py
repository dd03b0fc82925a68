"""Expert parallelism: each rank holds whole experts, and tokens travel to them by all-to-all.

Under plain FSDP2 every rank gathers every expert of a layer before its forward (and again in
its backward) and reduce-scatters their gradients: the bytes moved per step grow with the
experts' weights. With ``parallelism.expert_parallel_size: N`` the ``E`` experts of each MoE
layer are split over the ``N`` ranks of the data-parallel mesh, ``E / N`` whole experts each
(rank ``r`` owns experts ``r * E/N .. (r+1) * E/N - 1``), and never gathered; instead each
(token, expert) pair's hidden row goes to the expert's owner and its output comes back
(GShard, Lepikhin et al., 2020, https://arxiv.org/abs/2006.16668; torchtitan's
``ExpertParallel``). The bytes moved then grow with the routed tokens.

One layer's exchange, for the rows already sorted by expert:

1. the per-expert row counts go to every rank first (one small ``all_to_all_single``), so each
   rank knows how many rows it receives from each peer;
2. the rows go out in one variable-size ``all_to_all_single`` (no padding to a capacity, no
   token dropped); the received rows are regrouped by local expert and the grouped matmul
   runs on this rank's experts only;
3. the outputs return by the reverse exchange. The backward of each exchange is the other
   one (``tunelab.distributed.collectives.all_to_all_rows``).

Expert groups smaller than the world (``N`` dividing the ``W`` processes, ``R = W / N``
replicas): the experts live on a 2-D ``(replicate, ep)`` mesh, consecutive ranks forming one
expert group (torchrun numbers a node's GPUs consecutively, so a group is within a node)::

    W = 4, N = 2:          ep ->
                  replicate [[0, 1],    ranks 0 and 1: experts 0..E/2-1 and E/2..E-1, tokens
                      |      [2, 3]]    exchanged between them only; ranks 2 and 3 the same
                      v                 experts again, exchanging among themselves

Each rank holds ``E / N`` whole experts, ``DTensor`` ``(Replicate(), Shard(0))``; the
all-to-all runs within the ``ep`` group, and the experts' gradients are summed over the
``replicate`` group (one all-reduce per weight and micro-batch, ``ExpertParallel.local``). The
other weights are FSDP2's, sharded over all ``W`` processes as without expert parallelism.

With ``N = W`` the mesh is 1-D and expert weights stay ``DTensor`` ``Shard(0)`` on the same mesh
FSDP2 shards everything else over (FSDP2 is told to ignore them). Either way each weight's
placement is one DCP reads and writes as any other, so a checkpoint or an export of an
expert-parallel run is the same DCP state and the same bytes as the FSDP run's, and either
resumes the other.

Gradients: each rank's objective is its token-loss sum times the world size ``W`` over the
global token count, and FSDP2 averages over ranks; an owned expert's gradient arrives summed
over the ``N`` ranks of its group whose tokens it served, and the ``R`` replicas hold the sums
of the other groups: the sum over replicas divided by ``W`` is FSDP's average
(``ExpertParallel.local``).

With tensor parallelism (``T`` ranks splitting each matmul, ``tunelab.distributed.tensor_parallel``)
the experts take no part in the split: attention's output leaves each tp rank with its own
``seq / T`` tokens of the same samples (sequence parallelism), the router runs on them, and
they travel to their experts as above. An expert group is then ``N / T`` whole tp groups of
consecutive ranks (``N`` a multiple of ``T``: the ep dimension borrows the tp ranks and some
data-parallel ones, as torchtitan's ``ep = dp_shard_in_ep x tp``)::

    W = 4, T = 2, N = 2 (FSDP 2 x tp 2):      tp ->
                                      shard [[0, 1],   ranks 0 and 1: one sample stream,
                                        |    [2, 3]]   attention split by heads; their tokens
                                        v              (half the sequence each) go to experts
                                                       0..E/2-1 on rank 0, E/2..E-1 on rank 1
    the expert mesh (replicate 2, ep 2): [[0, 1], [2, 3]], the same groups

Each rank's objective then carries ``W / T``, the data-parallel size ``D`` (the tp ranks count
each token ``T`` times: ``tunelab.distributed.tensor_parallel.tensor_parallel_size``), and an
expert's gradient is divided by ``D`` instead of ``W``.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tunelab.distributed.collectives import all_to_all_rows
from tunelab.errors import ConfigError

EXPERT_REPLICATE_DIM = "replicate"
"""The dimension of an expert mesh across which the same experts are held again."""
EXPERT_DIM = "ep"
"""The dimension of an expert mesh whose ranks split each MoE layer's experts."""


@dataclass
class ExpertTraffic:
    """What the exchanges of one rank sent to other ranks since the last ``reset``.

    Rows and bytes sent to peers (a rank's rows for its own experts stay local and are not
    counted), forward and backward together: each routed pair's hidden row goes out once, its
    output row comes back once, and the backward sends both gradients the other way.
    """

    rows_sent: int = 0
    bytes_sent: int = 0

    def reset(self) -> None:
        """Start counting from zero."""
        self.rows_sent = self.bytes_sent = 0

    def counter(self, group: dist.ProcessGroup) -> Callable[[torch.Tensor, list[int]], None]:
        """What ``all_to_all_rows`` calls at each exchange in ``group``: counts what left."""
        rank = dist.get_rank(group)

        def count(rows: torch.Tensor, send_splits: list[int]) -> None:
            sent = sum(send_splits) - send_splits[rank]
            self.rows_sent += sent
            self.bytes_sent += sent * math.prod(rows.shape[1:]) * rows.element_size()

        return count


class _ExpertGradient(torch.autograd.Function):
    """The identity, whose backward scales the gradient and sums it over the replicas.

    ``scale``: the factor; ``group``: the ranks holding the same experts (None: no replica).
    """

    @staticmethod
    def forward(ctx, tensor, scale, group):
        ctx.scale, ctx.group = scale, group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad * ctx.scale
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class ExpertParallel:
    """The exchange of one model's MoE layers over a group of ranks (see the module docstring).

    Args:
        mesh: The mesh the experts are split over: 1-D (``Shard(0)``, every process) or 2-D
            ``(replicate, ep)`` (``(Replicate(), Shard(0))``, ``expert_parallel_mesh``).
        num_experts: Experts per MoE layer (``E``), divisible by the ``ep`` size.
        data_parallel_size: The processes reading different samples, ``D``, which each
            rank's objective is scaled by (None: every process of ``mesh``; with tensor
            parallelism the processes over the tp size).
    """

    def __init__(
        self, mesh: DeviceMesh, num_experts: int, data_parallel_size: int | None = None
    ) -> None:
        self.mesh = mesh
        self.data_parallel_size = data_parallel_size or mesh.size()
        self.group = mesh.get_group(mesh.ndim - 1)
        """The expert group: the ranks tokens travel between."""
        self.replicas = mesh.get_group(0) if mesh.ndim == 2 else None
        """The ranks holding the same experts, whose gradients are summed (None: one each)."""
        self.size = mesh.size(mesh.ndim - 1)
        self.rank = dist.get_rank(self.group)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.size
        self.experts = slice(
            self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts
        )
        """The experts this process holds."""
        self.traffic = ExpertTraffic()

    def local(self, weight: DTensor) -> torch.Tensor:
        """This rank's experts of ``weight``; its gradient summed over replicas, over ``D``.

        The gradient arrives summed over the ranks of the expert group whose tokens the
        experts served, each rank's objective scaled by the data-parallel size ``D`` (the
        world size without tensor parallelism; FSDP2 averages over the data-parallel ranks);
        summed over the replicas (the other groups' tokens) and divided by ``D`` it is
        FSDP's average. Done here, not by a hook on the parameter, because materialising the
        meta model replaces the parameter objects.
        """
        if not weight.requires_grad:  # frozen (LoRA, QLoRA's NF4 experts): no gradient
            return weight.to_local()
        scale = 1.0 / self.data_parallel_size
        return _ExpertGradient.apply(weight.to_local(), scale, self.replicas)

    def run(self, rows: torch.Tensor, counts: torch.Tensor, compute) -> torch.Tensor:
        """Send ``rows`` to their experts' owners, apply ``compute`` there, bring the rows back.

        Args:
            rows: ``[S, D]`` (token, expert) rows sorted by global expert.
            counts: int ``[E]``, rows per global expert.
            compute: ``compute(rows, counts, experts)`` on rows sorted by local expert, with
                ``counts`` ``[E / N]`` and ``experts`` the local expert of each row.

        Returns:
            ``compute``'s output rows ``[S, out]``, in the order of ``rows``.
        """
        local = self.num_local_experts
        # 1. counts first: received[s, l] = rows rank s sends to this rank's expert l.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.group)
        received = received.view(self.size, local)
        send_splits = counts.view(self.size, local).sum(dim=1).tolist()
        receive_splits = received.sum(dim=1).tolist()
        # 2. the rows, grouped by source rank, then by local expert within each source.
        count = self.traffic.counter(self.group)
        arrived = all_to_all_rows(rows, send_splits, receive_splits, self.group, count)
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(self.size), received.reshape(-1)
        )
        by_expert = torch.argsort(expert_of_row, stable=True)
        out = compute(arrived[by_expert], received.sum(dim=0), expert_of_row[by_expert])
        # 3. back to (source rank, expert) order, and home.
        out = torch.empty_like(out).index_copy(0, by_expert, out)
        return all_to_all_rows(out, receive_splits, send_splits, self.group, count)


def expert_parallel_mesh(
    expert_parallel_size: int,
    device: torch.device,
    data_parallel: DeviceMesh | None,
    *,
    tensor_parallel_size: int = 1,
) -> DeviceMesh | None:
    """The mesh experts are split over, checked against the run.

    Args:
        expert_parallel_size: ``parallelism.expert_parallel_size`` (1: off), ``N``.
        device: This process's device.
        data_parallel: The recipe's data-parallel mesh (``data_parallel_mesh``): None for plain
            FSDP over every process, or HSDP's ``(replicate, shard)``: either way FSDP2
            averages the other weights' gradients over every process, as the experts' exchange
            assumes.
        tensor_parallel_size: ``parallelism.tensor_parallel_size``, ``T``: ``N`` must be a
            multiple of it, so an expert group is whole tp groups (their ranks hold different
            tokens of the same samples).

    Returns:
        None when ``N`` is 1; with ``N`` all ``W`` processes the 1-D mesh of them (without
        tensor parallelism also to be given to FSDP2); with fewer the 2-D
        ``(replicate, ep)`` mesh of ``W / N`` groups of ``N`` consecutive ranks (FSDP2 then
        shards the other weights over every process, or over the data-parallel ranks of the
        tensor-parallel world mesh).

    Raises:
        ConfigError: One line naming the numbers: the size does not divide the processes, or
            is not a multiple of the tensor-parallel size.
    """
    if expert_parallel_size == 1:
        return None
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    what = f"parallelism.expert_parallel_size: {expert_parallel_size}"
    if world_size % expert_parallel_size:
        raise ConfigError(f"{what} does not divide the {world_size} processes of this run")
    if expert_parallel_size % tensor_parallel_size:
        raise ConfigError(
            f"{what} is not a multiple of parallelism.tensor_parallel_size: "
            f"{tensor_parallel_size}: an expert group must hold whole tensor-parallel groups"
        )
    if expert_parallel_size == world_size:
        # Without tensor parallelism FSDP2 shards the other weights over this mesh too.
        name = "shard" if tensor_parallel_size == 1 else EXPERT_DIM
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=(name,))
    return init_device_mesh(
        device.type,
        (world_size // expert_parallel_size, expert_parallel_size),
        mesh_dim_names=(EXPERT_REPLICATE_DIM, EXPERT_DIM),
    )


def shard_experts(
    model: nn.Module, mesh: DeviceMesh, *, data_parallel_size: int | None = None
) -> set[nn.Parameter]:
    """Split every MoE layer's experts over ``mesh`` and route their tokens by all-to-all.

    Each expert weight (and bias) becomes a ``DTensor`` ``Shard(0)`` over ``mesh`` (``(Replicate(),
    Shard(0))`` on a 2-D mesh; still on the meta device when the model is: it is materialised
    and loaded like FSDP2's shards), and each ``MoEExperts`` gets the ``ExpertParallel``
    exchange, which also reduces the experts' gradients (``ExpertParallel.local``).

    Args:
        model: A decoder, before ``shard_model``.
        mesh: ``expert_parallel_mesh``'s: 1-D (every process, the mesh ``shard_model`` is
            then given without tensor parallelism) or 2-D ``(replicate, ep)``.
        data_parallel_size: The processes reading different samples (None: every process of
            ``mesh``; with tensor parallelism the processes over the tp size), which the
            experts' gradients are divided by (``ExpertParallel.local``).

    Returns:
        The expert parameters, for FSDP2 to ignore.

    LoRA on the experts (``ExpertLoRA``) stays with FSDP2: its factors are small, gathered
    whole, and each process uses its experts' slices (``ExpertParallel.experts``). Their
    gradients then come only from the owners (one per replica, each over its group's tokens),
    carrying the world-size factor, which FSDP2's average over every process removes.

    Raises:
        ConfigError: The model has no MoE layer, or the mesh size does not divide the number
            of experts.
    """
    layers = _expert_layers(model)
    size = mesh.size(mesh.ndim - 1)
    if not layers:
        raise ConfigError(
            f"parallelism.expert_parallel_size: {size} needs a mixture-of-experts model; this "
            "one has no MoE layer"
        )
    num_experts = layers[0].num_experts
    if num_experts % size:
        raise ConfigError(
            f"parallelism.expert_parallel_size: {size} does not divide the model's "
            f"{num_experts} experts"
        )
    exchange = ExpertParallel(mesh, num_experts, data_parallel_size)
    owned: set[nn.Parameter] = set()
    for layer in layers:
        for name, param in list(layer.named_parameters(recurse=False)):
            sharded = nn.Parameter(_split(param.data, mesh), requires_grad=param.requires_grad)
            setattr(layer, name, sharded)
            owned.add(sharded)
        layer.expert_parallel = exchange
    return owned


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The split expert weights of ``model`` (``shard_experts``), for FSDP2 to ignore.

    Read again after anything replaces them (QLoRA packs them into NF4 parameters).
    """
    return {
        param
        for layer in _expert_layers(model)
        if layer.expert_parallel is not None
        for param in layer.parameters(recurse=False)
    }


def _split(tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    # Whole experts split over the last dimension, held again along the first of a 2-D mesh.
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    # On the meta device there are no values to scatter: only the local shape matters.
    if tensor.device.type != "meta":
        return distribute_tensor(tensor, mesh, placements)
    rows = tensor.shape[0] // mesh.size(mesh.ndim - 1)
    return DTensor.from_local(
        tensor.new_empty(rows, *tensor.shape[1:]), mesh, placements, run_check=False,
        shape=tensor.shape, stride=tensor.stride(),
    )  # fmt: skip


def expert_traffic(model: nn.Module) -> ExpertTraffic | None:
    """The ``ExpertTraffic`` of a model's exchange (None: its experts are not split)."""
    for module in _expert_layers(model):
        if module.expert_parallel is not None:
            return module.expert_parallel.traffic
    return None


def _expert_layers(model: nn.Module) -> list[nn.Module]:
    # The layers that take an exchange: an ``expert_parallel`` attribute (None until split)
    # beside ``num_experts``, as ``tunelab.modules.moe.MoEExperts`` has. Found by those
    # attributes, not by class: modules and distributed are one layer and import neither.
    return [
        module
        for module in model.modules()
        if hasattr(module, "expert_parallel") and hasattr(module, "num_experts")
    ]
