"""Asynchronous GRPO on split ranks: rollout ranks sample, trainer ranks train (``rollout.ranks``).

With ``rollout.ranks`` R > 0, the last R processes of the torchrun job are rollout ranks and
the first T = world - R train. The trainers' default process group holds only them (made by
:func:`split_ranks` from the job's rendezvous store under its own prefix), so their FSDP mesh,
data loader, checkpoints, metric sums and stop-signal agreement are those of a T-process run;
a rollout rank never joins it. Every process joins one more gloo group, the rollout channel
(global ranks), over which a trainer and its rollout rank exchange point-to-point messages with
:func:`~tunelab.rl.weight_sync.send_weights`: raw tensor bytes and a JSON header, each bucket
checked against its SHA-256, nothing unpickled, every wait bounded by the run's
``parallelism.collective_timeout_s`` (a dead or stalled peer ends the run with one line naming
its rank).

Trainer rank t is served by rollout rank ``T + t % R``. The schedule stays the fixed-depth one of
:class:`~tunelab.rl.RolloutPipeline`: at step g the trainer asks for the batches up to g + k
(their prompts: the dataset indices its loader drew), each with the policy of step g, which it
sends first when its rollout rank does not hold it yet (the trainable weights: for LoRA the
adapter, for full fine-tuning every weight, gathered whole and sent in buckets). A rollout rank
samples them with the seeds of the step they train (:func:`~tunelab.rl.sampling_seeds`), so
which policy sampled which batch, and with which random numbers, depends on (seed, step, k)
only: a split run equals the colocated ``rollout.mode: async`` run with as many trainers, and a
step checkpoint holds every batch in flight (received first), so a resume is exact.

Each trainer keeps at most one request outstanding and collects its answer before the next
request: the rollout rank answers in order, so the two never wait on each other. With k = 1 a
rollout rank samples the batch of step g + 1 while its trainers train step g.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tunelab.errors import ConfigError
from tunelab.rl import weight_sync
from tunelab.rl.advantages import GroupSampler, ScoredGroups
from tunelab.rl.async_rollouts import InFlight, decode_in_flight, encode_in_flight

__all__ = ["RankSplit", "RemoteRollouts", "serve_rollouts", "split_ranks"]


@dataclass
class RankSplit:
    """Where this process sits in a job split into trainer and rollout ranks.

    Attributes:
        rank: This process's global rank.
        world_size: Processes in the job.
        num_rollout_ranks: ``rollout.ranks``: the last ones of the job.
        timeout_s: Longest wait for a peer at each stage of a transfer.
        channel: The gloo group over every process (global ranks) the transfers use.
        trainer_store: The trainers' rendezvous store (pass it to ``init_distributed``).
    """

    rank: int
    world_size: int
    num_rollout_ranks: int
    timeout_s: float
    channel: dist.ProcessGroup
    trainer_store: dist.Store

    @property
    def num_trainers(self) -> int:
        """Processes that train (the first ones of the job)."""
        return self.world_size - self.num_rollout_ranks

    @property
    def is_rollout(self) -> bool:
        """Whether this process samples for trainers instead of training."""
        return self.rank >= self.num_trainers

    def rollout_rank_of(self, trainer: int) -> int:
        """The rollout rank that samples for ``trainer``."""
        return self.num_trainers + trainer % self.num_rollout_ranks

    def trainers_of(self, rollout_rank: int) -> list[int]:
        """The trainer ranks ``rollout_rank`` samples for, in the order it serves them."""
        return [t for t in range(self.num_trainers) if self.rollout_rank_of(t) == rollout_rank]

    def device(self, device: str | None) -> torch.device:
        """A rollout rank's device (``device`` as the recipe's ``init_distributed`` picks it)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if torch.device(device).type == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device(device)


def split_ranks(num_rollout_ranks: int, *, timeout_s: float) -> RankSplit | None:
    """Split the torchrun job into trainer and rollout ranks (call it before ``init_distributed``).

    On a trainer the environment's ``WORLD_SIZE`` becomes the number of trainers, so whatever
    reads it (the output lock, error reports) sees the trainers' world.

    Args:
        num_rollout_ranks: ``rollout.ranks`` (0: no split, returns None).
        timeout_s: ``parallelism.collective_timeout_s``: the longest wait in a transfer.

    Returns:
        This process's place, or None without a split.

    Raises:
        ConfigError: The job has too few processes for the split.
    """
    if num_rollout_ranks == 0:
        return None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size - num_rollout_ranks < num_rollout_ranks:
        raise ConfigError(
            f"key 'rollout.ranks': {num_rollout_ranks} rollout ranks need at least as many "
            f"trainer ranks, and the job has {world_size} processes; launch at least "
            f"{2 * num_rollout_ranks} (--nproc_per_node) or set fewer rollout.ranks"
        )
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    channel = dist.ProcessGroupGloo(
        dist.PrefixStore("tunelab/rollout_channel", store), rank, world_size, timeout
    )
    split = RankSplit(
        rank,
        world_size,
        num_rollout_ranks,
        timeout_s,
        channel,
        dist.PrefixStore("tunelab/trainers", store),
    )
    if not split.is_rollout:
        os.environ["WORLD_SIZE"] = str(split.num_trainers)
    return split


def _text_tensor(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _tensor_text(tensor: torch.Tensor) -> Any:
    return json.loads(tensor.numpy().tobytes())


class RemoteRollouts:
    """A trainer rank's link to its rollout rank: requests batches, sends the policy, collects.

    Args:
        split: The job's split (this process a trainer).
        model: The trained model: its trainable weights are what the rollout rank receives.
        device: Where the received batches go.
    """

    def __init__(self, split: RankSplit, model: torch.nn.Module, device: torch.device) -> None:
        self.split, self.device = split, device
        self.peer = split.rollout_rank_of(split.rank)
        # The lowest trainer a rollout rank serves sends it the weights.
        self.sends_weights = split.trainers_of(self.peer)[0] == split.rank
        self.trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.policy_held: int | None = None  # the step whose policy the rollout ranks hold
        self.outstanding: tuple[int, dict[str, Any]] | None = None
        self.totals = {"trainer_idle": 0.0, "rollout_idle": 0.0, "transfer": 0.0, "bytes": 0.0}

    def request(
        self, indices: list[list[int]], step: int, policy_step: int
    ) -> Callable[[], list[ScoredGroups]]:
        """Ask for the batch trained at ``step`` (its micro-batches' prompt indices).

        A collective over the trainers when the policy changed since the last request (the
        sharded weights are gathered whole).

        Args:
            indices: The dataset indices of each micro-batch.
            step: The step that trains on the batch (its sampling seeds).
            policy_step: The live policy's step (the rollout rank samples with it).

        Returns:
            Waits for the batch and returns its scored micro-batches.
        """
        self._collect()
        tensors = {"request": _text_tensor({"step": step, "policy_step": policy_step,
                                            "indices": indices})}  # fmt: skip
        if self.policy_held != policy_step:
            weights = {
                name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                for name, p in self.trainable.items()
            }
            self.policy_held = policy_step
            if self.sends_weights:
                tensors |= weights
        stats = weight_sync.send_weights(
            tensors, [self.peer], timeout_s=self.split.timeout_s, group=self.split.channel
        )
        if len(tensors) > 1:  # the policy went with the request: its time and tensor bytes
            self.totals["transfer"] += stats.seconds
            self.totals["bytes"] += sum(
                value.numel() * value.element_size() for name, value in tensors.items()
                if name != "request"
            )  # fmt: skip
        answer: dict[str, Any] = {}
        self.outstanding = (step, answer)
        return lambda: self._answer(answer)

    def _answer(self, answer: dict[str, Any]) -> list[ScoredGroups]:
        if "parts" not in answer:
            self._collect()
        return answer["parts"]

    def _collect(self) -> None:
        if self.outstanding is None:
            return
        step, answer = self.outstanding
        self.outstanding = None
        tensors, stats = weight_sync.receive_weights(
            self.peer,
            timeout_s=self.split.timeout_s,
            group=self.split.channel,
            sender_role="rollout rank",
        )
        self.totals["trainer_idle"] += stats.seconds
        record = _tensor_text(tensors["rollouts"])
        batch = decode_in_flight(record["batch"], self.device)
        assert batch.step == step, (batch.step, step)
        self.totals["rollout_idle"] += float(record["idle_seconds"])
        answer["parts"] = batch.parts

    def metrics(self) -> dict[str, float]:
        """Seconds and bytes since the last call (``async/*``), then starts counting afresh.

        ``async/trainer_idle_seconds``: waiting for batches (their transfer included);
        ``async/rollout_idle_seconds``: the rollout rank waiting for requests;
        ``async/weight_transfer_seconds`` and ``_bytes``: sending the policy (bytes to one
        rollout rank; 0 on the trainers that do not send it).
        """
        totals, self.totals = self.totals, dict.fromkeys(self.totals, 0.0)
        return {
            "async/trainer_idle_seconds": totals["trainer_idle"],
            "async/rollout_idle_seconds": totals["rollout_idle"],
            "async/weight_transfer_seconds": totals["transfer"],
            "async/weight_transfer_bytes": totals["bytes"],
        }

    def close(self) -> None:
        """Tell the rollout rank this trainer is done (after its last batch was taken)."""
        self._collect()
        weight_sync.send_weights(
            {"request": _text_tensor({"stop": True})},
            [self.peer],
            timeout_s=self.split.timeout_s,
            group=self.split.channel,
        )


def serve_rollouts(split: RankSplit, groups: GroupSampler, model: torch.nn.Module) -> None:
    """A rollout rank's loop: sample and score what its trainers ask for, until they stop.

    Each round it receives one request from each of its trainers (in rank order, loading the
    policy when one comes with it), samples them in that order, and answers each trainer with
    the scored batch: the in-flight record of :mod:`tunelab.rl.async_rollouts`, as JSON bytes.

    Args:
        split: The job's split (this process a rollout rank).
        groups: Samples and scores a micro-batch (on ``model``).
        model: The model the rollout engine generates with (its weights are replaced by the
            trainers' policy).

    Raises:
        WeightTransferError: A trainer died or stalled past the timeout (named).
    """
    parameters = dict(model.named_parameters())
    trainers = split.trainers_of(split.rank)
    idle = 0.0
    while True:
        requests = []
        for trainer in trainers:
            tensors, stats = weight_sync.receive_weights(
                trainer, timeout_s=split.timeout_s, group=split.channel
            )
            idle += stats.seconds
            request = _tensor_text(tensors.pop("request"))
            with torch.no_grad():
                for name, value in tensors.items():
                    parameters[name].copy_(value)
            requests.append((trainer, request))
        if any(request.get("stop") for _, request in requests):
            return
        answers = []
        for trainer, request in requests:
            step = int(request["step"])
            parts = [groups.sample(indices, step) for indices in request["indices"]]
            batch = InFlight(step, int(request["policy_step"]), parts)
            answers.append((trainer, encode_in_flight(batch)))
        for trainer, batch in answers:
            weight_sync.send_weights(
                {"rollouts": _text_tensor({"batch": batch, "idle_seconds": idle})},
                [trainer],
                timeout_s=split.timeout_s,
                group=split.channel,
                receiver_role="trainer rank",
            )
            idle = 0.0
