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
(their prompts: the dataset indices its loader drew), each with the policy of step g. The
policy travels apart from the requests (its own tag of the channel) and is sent right after
each update whose policy will sample (:meth:`RemoteRollouts.send_policy`), by a background
thread, while the trainer goes on with its bookkeeping and next step. No trainer gathers it:
each sends every rollout rank its own pieces (its FSDP shards of the trainable weights: for
LoRA the adapter, for full fine-tuning every weight; a tensor kept whole on every trainer from
trainer 0 alone), and the rollout rank copies them into place, so what it samples with is, byte
for byte, the whole policy. A rollout rank samples the batches with the seeds of the step they
train (:func:`~tunelab.rl.sampling_seeds`), so which policy sampled which batch, and with
which random numbers, depends on (seed, step, k) only: a split run equals the colocated
``rollout.mode: async`` run with as many trainers, and a step checkpoint holds every batch in
flight (received first), so a resume is exact, also with another number of rollout ranks (or
none) as long as the trainers are as many.

Each trainer keeps at most one request outstanding and collects its answer before the next
request: the rollout rank answers in order, so the two never wait on each other. With k = 1 a
rollout rank samples the batch of step g + 1 while its trainers train step g. A stop request
(:meth:`RemoteRollouts.close`, also on a stop signal, after the trainers' checkpoint) names the
last policy sent, which the rollout rank takes before it returns.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tunelab.errors import ConfigError
from tunelab.rl import weight_sync
from tunelab.rl.advantages import GroupSampler, ScoredGroups
from tunelab.rl.async_rollouts import InFlight, decode_in_flight, encode_in_flight
from tunelab.rl.policy_transfer import PolicySender, receive_policy

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
        rollout_group: On a rollout rank of several, a gloo group over the rollout ranks (their
            refill rounds agree over it); None otherwise.
    """

    rank: int
    world_size: int
    num_rollout_ranks: int
    timeout_s: float
    channel: dist.ProcessGroup
    trainer_store: dist.Store
    rollout_group: dist.ProcessGroup | None = None

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

    def sum_over_rollout_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the rollout ranks in place and return it (a rollout rank's call)."""
        if self.rollout_group is not None:
            self.rollout_group.allreduce([tensor]).wait()
        return tensor

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
    elif num_rollout_ranks > 1:
        split.rollout_group = dist.ProcessGroupGloo(
            dist.PrefixStore("tunelab/rollout_ranks", store),
            rank - split.num_trainers,
            num_rollout_ranks,
            timeout,
        )
    return split


class RemoteRollouts:
    """A trainer rank's link to the rollout ranks: requests batches, sends the policy, collects.

    Requests and answers go to and from this trainer's own rollout rank (tag 0 of the
    channel). The policy goes to every rollout rank on a stream of its own, in this trainer's
    pieces, from a background thread (:class:`~tunelab.rl.policy_transfer.PolicySender`):
    :meth:`send_policy` returns at once, so the transfer overlaps whatever the trainer does
    next, and no trainer gathers the weights.

    Args:
        split: The job's split (this process a trainer).
        model: The trained model: its trainable weights are what the rollout ranks receive.
        device: Where the received batches go.
    """

    def __init__(self, split: RankSplit, model: torch.nn.Module, device: torch.device) -> None:
        self.split, self.device = split, device
        self.peer = split.rollout_rank_of(split.rank)
        self.policy = PolicySender(
            {n: p for n, p in model.named_parameters() if p.requires_grad},
            split.rank,
            list(range(split.num_trainers, split.world_size)),
            timeout_s=split.timeout_s,
            group=split.channel,
        )
        self.policy_sent: int | None = None  # the step of the last policy sent
        self.outstanding: tuple[int, dict[str, Any]] | None = None
        self.totals = dict.fromkeys(("trainer_idle", "rollout_idle", "bytes", "send_blocked"), 0.0)

    def send_policy(self, policy_step: int) -> None:
        """Send the live policy (the weights after ``policy_step`` updates) to every rollout rank.

        Waits for the previous send first (that and copying this trainer's pieces count as
        ``send_blocked``) and leaves the transfer to a background thread. Every trainer calls
        it at the same steps (no collective: each sends its own pieces).

        Args:
            policy_step: The policy's step (requests sampled with it name it).

        Raises:
            WeightTransferError: The previous send failed (names the rollout rank).
        """
        self.totals["send_blocked"] += self.policy.send(policy_step)
        self.policy_sent = policy_step
        self.totals["bytes"] += self.policy.policy_bytes

    def request(
        self, indices: list[list[int]], step: int, policy_step: int
    ) -> Callable[[], list[ScoredGroups]]:
        """Ask for the batch trained at ``step`` (its micro-batches' prompt indices).

        Sends the policy first when the rollout ranks were not sent ``policy_step``'s (the
        first request of a run or a resume; later ones are sent right after each update).

        Args:
            indices: The dataset indices of each micro-batch.
            step: The step that trains on the batch (its sampling seeds).
            policy_step: The live policy's step (the rollout rank samples with it).

        Returns:
            Waits for the batch and returns its scored micro-batches.
        """
        self._collect()
        if self.policy_sent != policy_step:
            self.send_policy(policy_step)
        request = {"step": step, "policy_step": policy_step, "indices": indices}
        self._send_request(request)
        answer: dict[str, Any] = {}
        self.outstanding = (step, answer)
        return lambda: self._answer(answer)

    def _send_request(self, request: dict[str, Any]) -> None:
        weight_sync.send_weights(
            {"request": weight_sync.json_tensor(request)},
            [self.peer],
            timeout_s=self.split.timeout_s,
            group=self.split.channel,
        )

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
        record = weight_sync.tensor_json(tensors["rollouts"])
        batch = decode_in_flight(record["batch"], self.device)
        assert batch.step == step, (batch.step, step)
        self.totals["rollout_idle"] += float(record["idle_seconds"])
        answer["parts"] = batch.parts

    def metrics(self) -> dict[str, float]:
        """Seconds and bytes since the last call (``async/*``), then starts counting afresh.

        ``async/trainer_idle_seconds``: waiting for batches (their transfer included);
        ``async/rollout_idle_seconds``: the rollout rank waiting for requests and policies;
        ``async/weight_transfer_seconds``: the policy sends that finished, in the background;
        ``async/weight_send_blocked_seconds``: what the sends cost the training loop (copying
        the pieces, waiting for the previous send); ``async/weight_transfer_bytes``: the
        policy bytes each rollout rank was sent (from every trainer together).
        """
        totals, self.totals = self.totals, dict.fromkeys(self.totals, 0.0)
        return {
            "async/trainer_idle_seconds": totals["trainer_idle"],
            "async/rollout_idle_seconds": totals["rollout_idle"],
            "async/weight_transfer_seconds": self.policy.transfer_seconds(),
            "async/weight_send_blocked_seconds": totals["send_blocked"],
            "async/weight_transfer_bytes": totals["bytes"],
        }

    def close(self) -> None:
        """Tell the rollout rank this trainer is done (after its last batch was taken).

        The stop names the last policy sent, so the rollout rank takes it before it exits
        and the background send ends.
        """
        self._collect()
        self._send_request({"stop": True, "policy_step": self.policy_sent})
        self.policy.wait()


def serve_rollouts(
    split: RankSplit,
    groups: GroupSampler,
    model: torch.nn.Module,
    *,
    refill_rounds: int = 0,
    prompts_per_round: int = 0,
) -> None:
    """A rollout rank's loop: sample and score what its trainers ask for, until they stop.

    Each round it receives one request from each of its trainers (in rank order; every
    trainer asks for the same step's batch), takes the policies every trainer sent until it
    holds the one the requests name, samples them in that order, refills them (DAPO's
    re-sampling, as each trainer would refill its own and, over the rollout ranks, as all the
    trainers would together: :meth:`~tunelab.rl.GroupSampler.refill_ranks`), and answers each
    trainer with the scored batch: the in-flight record of :mod:`tunelab.rl.async_rollouts`,
    as JSON bytes.

    Args:
        split: The job's split (this process a rollout rank).
        groups: Samples and scores a micro-batch (on ``model``).
        model: The model the rollout engine generates with (its weights are replaced by the
            trainers' policy).
        refill_rounds: ``rollout.dynamic_sampling_refill_rounds`` (0: no refills).
        prompts_per_round: Prompts per trainer per refill round (its micro-batch size).

    Raises:
        WeightTransferError: A trainer died or stalled past the timeout (named).
    """
    parameters = dict(model.named_parameters())
    trainers = split.trainers_of(split.rank)
    idle, held = 0.0, None
    while True:
        requests = []
        for trainer in trainers:
            # A trainer that ended closes the channel: this rank's failure then says so in
            # words the launcher reads as a consequence (``peer_closed``), never the cause.
            tensors, stats = weight_sync.receive_weights(
                trainer, timeout_s=split.timeout_s, group=split.channel
            )
            idle += stats.seconds
            requests.append((trainer, weight_sync.tensor_json(tensors["request"])))
        wanted = requests[0][1]["policy_step"]
        while wanted is not None and held != wanted:
            held, seconds = receive_policy(
                split.num_trainers, parameters, rank=split.rank, timeout_s=split.timeout_s,
                group=split.channel,
            )  # fmt: skip
            idle += seconds
        if any(request.get("stop") for _, request in requests):
            return
        step = int(requests[0][1]["step"])
        scored = {
            trainer: [groups.sample(indices, step) for indices in request["indices"]]
            for trainer, request in requests
        }
        if refill_rounds:
            refills = groups.refill_ranks(
                scored, step, prompts_per_round=prompts_per_round, max_rounds=refill_rounds,
                world_size=split.num_trainers, reduce=split.sum_over_rollout_ranks,
            )  # fmt: skip
            scored = {trainer: parts + refills[trainer] for trainer, parts in scored.items()}
        answers = []
        for trainer, request in requests:
            assert int(request["step"]) == step, (request["step"], step)
            batch = InFlight(step, int(request["policy_step"]), scored[trainer])
            answers.append((trainer, encode_in_flight(batch)))
        for trainer, batch in answers:
            weight_sync.send_weights(
                {"rollouts": weight_sync.json_tensor({"batch": batch, "idle_seconds": idle})},
                [trainer],
                timeout_s=split.timeout_s,
                group=split.channel,
                receiver_role="trainer rank",
            )
            idle = 0.0
