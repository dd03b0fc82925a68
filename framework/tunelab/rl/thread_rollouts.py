"""Colocated asynchronous GRPO with sampling overlapped: a whole copy of the policy samples on a thread.

With ``rollout.mode: async`` on the training processes (``rollout.ranks: 0``) and
``rollout.overlap: true``, each process keeps a whole, unsharded copy of the model (the
*replica*) and a worker thread that samples on it. At step ``g`` the batches up to ``g + k`` are
asked for as in the plain colocated run (:class:`~tunelab.rl.RolloutPipeline`), each to be
sampled with the policy of step ``g``: the trainer copies that policy (one all-gather of every
process's shards of the trainable weights, on the training thread) and hands the copy, the
prompts and the step to the worker, which loads the copy into the replica and samples while the
training thread trains step ``g`` (the update's forward and backward, the optimizer step, the
bookkeeping). Sampling and training run on different modules, so neither touches the other's
weights, caches or FSDP state; the worker runs no collective.

Which policy sampled which batch, and with which random numbers (the seeds of the step that
trains on it, :func:`~tunelab.rl.sampling_seeds`), is the plain colocated run's, so the
completions, metrics and exports equal it bit for bit (the replica computes as the gathered
model does: the rollout ranks of ``rollout.ranks`` sample on the same kind of copy) and a step
checkpoint waits for the batch being sampled and holds it, so a resume is exact.

What it costs: a second whole copy of the model on every process (LoRA: the base too), and the
thread shares the process's cores with training. Where it pays: where the training thread waits
(collectives, slower ranks) and sampling on the plain copy is cheaper than on the FSDP model
(no per-module hooks or gathers); see docs/recipes.md and the grpo_async benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tunelab.rl.advantages import GroupSampler, ScoredGroups

__all__ = ["ThreadRollouts", "gather_trainable"]


@torch.no_grad()
def gather_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable weight of ``model`` whole, in one all-gather (a collective).

    Each process's FSDP2 shard (``Shard(0)``: rows ``r * ceil(n / world)`` on) is padded to
    ``ceil(n / world)`` rows, all of them are flattened into one buffer, and one
    ``all_gather_into_tensor`` brings every process's buffer; a weight every process holds
    whole is taken from this process; a weight placed otherwise (HSDP's 2-D mesh) is gathered
    on its own (``full_tensor``).

    Args:
        model: The trained model (FSDP2-sharded or plain).

    Returns:
        Name -> the whole weight (new tensors, not views of the live ones).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    pieces, layout, other = [], [], {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if isinstance(param, DTensor) and not _sharded_rows_over_world(param, world):
            other[name] = param.full_tensor().detach().clone()  # HSDP and the like
        elif isinstance(param, DTensor):
            rows = -(-param.shape[0] // world)
            width = int(torch.Size(param.shape[1:]).numel())
            local = param.to_local().detach().reshape(-1)
            flat = torch.zeros(rows * width, dtype=param.dtype, device=local.device)
            flat[: local.numel()] = local
            pieces.append(flat)
            layout.append((name, param.shape, rows * width, rows))
        else:
            pieces.append(param.detach().reshape(-1))
            layout.append((name, param.shape, param.numel(), None))
    if not pieces:
        return other
    mine = torch.cat(pieces)
    every = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
    if world > 1:
        dist.all_gather_into_tensor(every, mine)
    else:
        every.copy_(mine)
    every = every.view(world, -1)
    whole, offset = {}, 0
    for name, shape, size, rows in layout:
        chunk = every[:, offset : offset + size]
        offset += size
        if rows is None:  # held whole by every process: this process's copy
            whole[name] = chunk[dist.get_rank() if world > 1 else 0].reshape(shape).clone()
        else:
            whole[name] = chunk.reshape(world * rows, -1)[: shape[0]].reshape(shape).clone()
    return whole | other


def _sharded_rows_over_world(param: DTensor, world: int) -> bool:
    # Plain FSDP2: a 1-D mesh over every process, rows split (Shard(0)).
    return (
        param.device_mesh.ndim == 1
        and param.device_mesh.size() == world
        and len(param.placements) == 1
        and isinstance(param.placements[0], Shard)
        and param.placements[0].dim == 0
    )


class ThreadRollouts:
    """A worker thread sampling on a whole copy of the policy while the training thread trains.

    Args:
        model: The trained model (its trainable weights are the policy).
        replica: A whole, unsharded copy of it (the same architecture, adapters and names),
            not trained: the worker loads each policy into it.
        groups: Samples and scores a micro-batch on ``replica`` (its engine generates there).
    """

    def __init__(self, model: nn.Module, replica: nn.Module, groups: GroupSampler) -> None:
        self.model, self.groups = model, groups
        self.parameters = dict(replica.named_parameters())
        missing = sorted(
            name for name, p in model.named_parameters() if p.requires_grad
            if name not in self.parameters
        )  # fmt: skip
        assert not missing, f"the replica lacks trained weights {missing[:3]}"
        replica.train()  # as the model: the engine switches to eval while it samples
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tunelab-sampler")

    def request(self, indices: list[list[int]], step: int) -> Callable[[], list[ScoredGroups]]:
        """Sample the batch trained at ``step`` with the live policy, on the worker thread.

        A collective (the policy's all-gather): every process calls it at the same steps.
        Requests run one after the other, in order, each with the policy copied at its call.

        Args:
            indices: The dataset indices of each micro-batch.
            step: The step that trains on the batch (its sampling seeds).

        Returns:
            Waits for the batch and returns its scored micro-batches (re-raising the worker's
            error, if any).
        """
        policy = gather_trainable(self.model)
        return self.worker.submit(self._sample, policy, indices, step).result

    @torch.no_grad()
    def _sample(
        self, policy: dict[str, torch.Tensor], indices: list[list[int]], step: int
    ) -> list[ScoredGroups]:
        for name, value in policy.items():
            self.parameters[name].copy_(value)
        return [self.groups.sample(index, step) for index in indices]

    def close(self) -> None:
        """Wait for the sampling in progress and stop the worker."""
        self.worker.shutdown(wait=True)
