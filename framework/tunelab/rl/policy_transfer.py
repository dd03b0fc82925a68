"""The policy from trainer ranks to rollout ranks: in pieces, in the background (``rollout.ranks``).

After each update whose policy will sample, every trainer sends every rollout rank its own
pieces of the trainable weights (:class:`PolicySender`): its FSDP shard of each sharded tensor
(one replica's, when replicated over a mesh dimension), and each tensor every trainer keeps
whole from trainer 0 alone. No trainer gathers anything. The pieces are copied at once (the
next update may change the live weights) and a background thread sends them with
:func:`~tunelab.rl.weight_sync.send_weights` (checksummed buckets, an acknowledgement, every
wait bounded), so the transfer overlaps whatever the trainer does next; the trainer waits only
when the previous send has not finished. A rollout rank takes one message from every trainer
(:func:`receive_policy`) and copies each piece into place, rows (or any slice) at their
offsets: the whole policy, byte for byte what a gather would give. Policies travel on their
own tag of the channel (:data:`POLICY_TAG`), so the requests and answers the trainer's main
thread exchanges with its rollout rank meanwhile never mix with them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tunelab.errors import ConfigError
from tunelab.rl import weight_sync

__all__ = ["POLICY_TAG", "PolicySender", "receive_policy"]

POLICY_TAG = 1
"""The channel tag of policy transfers (requests and answers use tag 0)."""


@dataclass
class _Piece:
    """A trainer's piece of one trainable tensor: where it sits in the whole tensor."""

    parameter: torch.Tensor
    offsets: list[int]

    def local(self) -> torch.Tensor:
        value = self.parameter
        return value.to_local() if isinstance(value, DTensor) else value


def _policy_pieces(trainable: dict[str, torch.Tensor], rank: int) -> dict[str, _Piece]:
    """The pieces of ``trainable`` trainer ``rank`` sends to each rollout rank."""
    pieces = {}
    for name, parameter in trainable.items():
        if not isinstance(parameter, DTensor):
            if rank == 0:
                pieces[name] = _Piece(parameter, [0] * parameter.dim())
            continue
        mesh, placements = parameter.device_mesh, parameter.placements
        coordinate = mesh.get_coordinate()
        if coordinate is None or any(
            isinstance(placement, Replicate) and coordinate[dim] != 0
            for dim, placement in enumerate(placements)
        ):
            continue  # another replica sends it
        shape, offsets = compute_local_shape_and_global_offset(parameter.shape, mesh, placements)
        local = parameter.to_local()
        if tuple(local.shape) != tuple(shape):
            raise ConfigError(
                f"key 'rollout.ranks': the trainers' layout of {name} ({placements}) cannot be "
                "sent in pieces; train with FSDP or tensor parallelism alone"
            )
        if local.numel():
            pieces[name] = _Piece(parameter, [int(offset) for offset in offsets])
    return pieces


class _Sending:
    """One send on a daemon thread (a failed run's exit never waits for it).

    Each of the send's waits is bounded by the transfer's timeout, so the thread ends in
    bounded time.
    """

    def __init__(self, send: Callable[[], None]) -> None:
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(send,), daemon=True, name="tunelab-policy-send"
        )
        self.thread.start()

    def _run(self, send: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            send()
        except BaseException as error:  # noqa: BLE001 - raised again by wait, in the loop
            self.error = error
        self.seconds = time.perf_counter() - start

    def wait(self) -> float:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.seconds


class PolicySender:
    """A trainer's side: its pieces of the policy to every rollout rank, in the background.

    Args:
        trainable: The trained weights by name (for LoRA the adapter, for full fine-tuning
            every weight), sharded or whole.
        rank: This trainer's rank among the trainers.
        receivers: The rollout ranks (of ``group``).
        timeout_s: Longest wait for a rollout rank at each stage of a transfer.
        group: The channel, addressed by its own ranks.
    """

    def __init__(
        self,
        trainable: dict[str, torch.Tensor],
        rank: int,
        receivers: list[int],
        *,
        timeout_s: float,
        group: dist.ProcessGroup,
    ) -> None:
        self.pieces = _policy_pieces(trainable, rank)
        self.receivers, self.timeout_s, self.group = receivers, timeout_s, group
        self.policy_bytes = sum(p.numel() * p.element_size() for p in trainable.values())
        """What each rollout rank receives per policy, from every trainer together."""
        self._sending: _Sending | None = None
        self._finished_seconds = 0.0

    def send(self, policy_step: int) -> float:
        """Start sending the live weights as the policy of ``policy_step``; returns at once.

        Waits for the previous send first, then copies this trainer's pieces.

        Args:
            policy_step: The policy's step (the requests sampled with it name it).

        Returns:
            The seconds it blocked the caller (the wait and the copy).

        Raises:
            WeightTransferError: The previous send failed (one line naming the rollout rank).
        """
        start = time.perf_counter()
        self.wait()
        record = {
            "policy_step": policy_step,
            "offsets": {name: piece.offsets for name, piece in self.pieces.items()},
        }
        tensors = {"policy": weight_sync.json_tensor(record)}
        for name, piece in self.pieces.items():
            tensors[name] = piece.local().detach().to("cpu", copy=True)

        def send() -> None:
            # One rollout rank after the other, each acknowledging before the next: no
            # acknowledgement waits on another rank's receive.
            for rank in self.receivers:
                weight_sync.send_weights(
                    tensors, [rank], timeout_s=self.timeout_s, group=self.group, tag=POLICY_TAG
                )

        self._sending = _Sending(send)
        return time.perf_counter() - start

    def wait(self) -> None:
        """Wait for the send in flight (its time goes to :meth:`transfer_seconds`).

        Raises:
            WeightTransferError: It failed (one line naming the rollout rank).
        """
        if self._sending is not None:
            sending, self._sending = self._sending, None
            self._finished_seconds += sending.wait()

    def transfer_seconds(self) -> float:
        """Wall seconds of the sends that finished since the last call."""
        seconds, self._finished_seconds = self._finished_seconds, 0.0
        return seconds


def receive_policy(
    num_senders: int,
    parameters: dict[str, torch.Tensor],
    *,
    rank: int,
    timeout_s: float,
    group: dist.ProcessGroup,
) -> tuple[int, float]:
    """Take one policy from every trainer (ranks ``0..num_senders - 1``) into ``parameters``.

    Args:
        num_senders: The trainers.
        parameters: The rollout model's parameters by name (written in place).
        rank: This rollout rank (for error messages).
        timeout_s: Longest wait for a trainer at each stage.
        group: The channel.

    Returns:
        The policy's step and the seconds it took.

    Raises:
        WeightTransferError: A trainer died or stalled, a checksum failed, or the pieces do
            not make whole tensors of every trained weight (one line naming the rank).
    """
    steps, seconds, filled = set(), 0.0, dict.fromkeys(parameters, 0)
    for trainer in range(num_senders):
        tensors, stats = weight_sync.receive_weights(
            trainer, timeout_s=timeout_s, group=group, tag=POLICY_TAG
        )
        seconds += stats.seconds
        header = weight_sync.tensor_json(tensors.pop("policy"))
        steps.add(int(header["policy_step"]))
        with torch.no_grad():
            for name, value in tensors.items():
                index = tuple(
                    slice(offset, offset + size)
                    for offset, size in zip(header["offsets"][name], value.shape, strict=True)
                )
                parameters[name][index].copy_(value)
                filled[name] += value.numel()
    trained = [name for name, value in parameters.items() if value.requires_grad or filled[name]]
    incomplete = [name for name in trained if filled[name] != parameters[name].numel()]
    if len(steps) != 1 or incomplete:
        raise weight_sync.WeightTransferError(
            f"rollout rank {rank}: the trainers' policy pieces do not fit together "
            f"(policy steps {sorted(steps)}, incomplete tensors {incomplete[:3]})"
        )
    return steps.pop(), seconds
