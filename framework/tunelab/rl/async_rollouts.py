"""Asynchronous GRPO's schedule: batches sampled ``max_lag`` policy updates ahead of training.

With ``rollout.mode: async`` and ``rollout.max_lag`` k, the batch trained at step ``s`` (0-based:
``s`` updates done before it) is sampled by the policy of step::

    behaviour_step(s) = max(s - k, first step of s's epoch)

a fixed pipeline depth: which policy sampled which batch is a function of the step, k and the
epoch length alone, never of timing, so two runs with one seed are identical and a resumed run
equals the uninterrupted one. :class:`RolloutPipeline` keeps the sampled batches not yet
trained on (at most k + 1); before the update of step ``g`` it samples, with the policy of
step ``g``, every batch up to ``g + k`` of the epoch. A new epoch starts with an empty pipeline
(its first k batches all come from the policy at its start): the data order is the loader's.

A step checkpoint holds the batches in flight (:meth:`RolloutPipeline.state_text`, in the
checksummed trainer state; tensors as raw little-endian bytes, never pickled), so a resumed run
trains on exactly the batches the uninterrupted run sampled with the policies it had then.
With k = 0 the pipeline samples each batch right before its update: synchronous GRPO.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tunelab.errors import CheckpointError
from tunelab.rl.advantages import ScoredGroups
from tunelab.rl.off_policy import OffPolicyCorrection
from tunelab.rl.step import Rollout

__all__ = [
    "InFlight",
    "RolloutPipeline",
    "behaviour_step",
    "decode_in_flight",
    "encode_in_flight",
    "lag_histogram",
]

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "bool": torch.bool,
}


def behaviour_step(step: int, max_lag: int, epoch_start: int) -> int:
    """The step whose policy samples the batch trained at ``step`` (see the module doc).

    Args:
        step: The training step (0-based: updates done before it).
        max_lag: ``rollout.max_lag`` (0: synchronous).
        epoch_start: The first step of ``step``'s epoch.
    """
    return max(step - max_lag, epoch_start)


def lag_histogram(steps_done: int, max_lag: int, steps_per_epoch: int) -> dict[str, float]:
    """Steps trained so far per lag, as metrics ``off_policy/lag_histogram/<lag>``.

    A function of the schedule alone (no state to checkpoint): the lag of step ``s`` is
    ``s - behaviour_step(s, max_lag, epoch_start)``, so a resumed run logs the uninterrupted
    run's counts.

    Args:
        steps_done: Updates done (the global step after this one).
        max_lag: ``rollout.max_lag`` (0: synchronous, every step at lag 0).
        steps_per_epoch: Steps per epoch (the pipeline restarts at each epoch).
    """
    counts = dict.fromkeys(range(max_lag + 1), 0.0)
    for step in range(steps_done):
        epoch_start = step - step % steps_per_epoch
        counts[step - behaviour_step(step, max_lag, epoch_start)] += 1
    return {f"off_policy/lag_histogram/{lag}": count for lag, count in counts.items()}


@dataclass
class InFlight:
    """One step's sampled batch, waiting for its update.

    Attributes:
        step: The step that trains on it.
        behaviour_step: The step whose policy sampled it.
        parts: Its scored micro-batches (refills included); or, while another rank samples
            it (``rollout.ranks``), what waits for them and returns them.
    """

    step: int
    behaviour_step: int
    parts: list[ScoredGroups] | Callable[[], list[ScoredGroups]]

    def received(self) -> list[ScoredGroups]:
        """Its scored micro-batches (waiting for them if another rank samples them)."""
        if callable(self.parts):
            self.parts = self.parts()
        return self.parts


class RolloutPipeline:
    """The batches sampled ahead of training, at a fixed depth of ``max_lag`` updates.

    Args:
        max_lag: ``rollout.max_lag`` (0: each batch sampled right before its update).
        device: Where restored rollout tensors go.
        correction: ``rollout.off_policy``: weighs the token losses of the batches taken with
            a lag (each lagged rollout's ``correction``); None: no weights.
    """

    def __init__(
        self, max_lag: int, device: torch.device, correction: OffPolicyCorrection | None = None
    ) -> None:
        self.max_lag = max_lag
        self.device = device
        self.correction = correction
        self.pending: dict[int, InFlight] = {}
        self.sample_seconds = 0.0

    def fill(self, step: int, epoch_end: int, sample: Callable[[int], list[ScoredGroups]]) -> None:
        """Sample, with the current policy (that of ``step``), the batches up to ``step + max_lag``.

        Args:
            step: The step about to train (its policy is the live one).
            epoch_end: One past the last step of the epoch (the pipeline does not cross it).
            sample: Samples the batch trained at a step (draws its prompts from the loader, in
                step order), or asks a rollout rank to and returns what waits for it.
        """
        for target in range(step, min(step + self.max_lag + 1, epoch_end)):
            if target not in self.pending:
                self.pending[target] = InFlight(target, step, sample(target))

    def samples_with(self, step: int, epoch_end: int, another_epoch: bool) -> bool:
        """Whether the policy of ``step`` samples a batch: the fill at ``step`` asks for one.

        Args:
            step: The updates done (its policy is the live one).
            epoch_end: One past the last step of the epoch of the last update.
            another_epoch: Whether an epoch follows it (its first fill samples).
        """
        if step >= epoch_end:
            return another_epoch
        last = min(step + self.max_lag + 1, epoch_end)
        return any(target not in self.pending for target in range(step, last))

    def take(self, step: int) -> InFlight:
        """The batch of ``step``; its rollouts carry their lag (``step - behaviour_step``).

        A lagged rollout also carries the pipeline's ``correction``, which the
        policy-gradient pass applies.

        In a run started (or resumed from an async checkpoint) with this ``max_lag`` the batch
        came from :func:`behaviour_step`; a synchronous checkpoint resumed as async starts with
        an empty pipeline, so its first batches have smaller lags.
        """
        batch = self.pending.pop(step)
        for part in batch.received():
            part.rollout.lag = step - batch.behaviour_step
            part.rollout.correction = self.correction if part.rollout.lag > 0 else None
        return batch

    def num_micro_batches(self) -> int:
        """Loader micro-batches the batches in flight drew (refills draw none)."""
        return sum(
            1
            for batch in self.pending.values()
            for part in batch.received()
            if "refill_prompts" not in part.sums
        )

    # -- checkpoint ---------------------------------------------------------------------

    def state_text(self) -> str:
        """Every rank's batches in flight, as one JSON text (a collective: every rank calls it).

        Kept as a string in the step checkpoint's progress record, whose numbers must be
        non-negative counts; tensors are base64 of their raw bytes, so values are exact.
        Batches a rollout rank is sampling are waited for first.
        """
        mine = json.dumps([encode_in_flight(batch) for batch in self.pending.values()])
        gathered: list[Any] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        return json.dumps(gathered)

    def load_text(self, text: str, where: str) -> None:
        """Restore this rank's batches in flight from :meth:`state_text`.

        Raises:
            CheckpointError: The record does not parse, or was saved by another number of
                training processes (the batches are per trainer; rollout ranks, which hold
                none, may differ).
        """
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        try:
            per_rank = json.loads(text)
            if len(per_rank) != world:
                raise CheckpointError(
                    f"{where}: the async rollouts in flight (rollout.max_lag > 0) were saved by "
                    f"{len(per_rank)} training processes and this run has {world}; resume on "
                    f"{len(per_rank)} (--nproc_per_node minus rollout.ranks)"
                )
            batches = [decode_in_flight(item, self.device) for item in json.loads(per_rank[rank])]
        except (ValueError, KeyError, TypeError, IndexError) as error:
            raise CheckpointError(f"{where}: unreadable rollouts in flight ({error})") from error
        self.pending = {batch.step: batch for batch in batches}


def _encode_tensor(tensor: torch.Tensor | None) -> dict[str, Any] | None:
    if tensor is None:
        return None
    tensor = tensor.detach().cpu().contiguous()
    raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "bytes": base64.b64encode(raw).decode(),
    }


def _decode_tensor(record: dict[str, Any] | None, device: torch.device) -> torch.Tensor | None:
    if record is None:
        return None
    dtype = _DTYPES[record["dtype"]]
    shape = [int(size) for size in record["shape"]]
    raw = bytearray(base64.b64decode(record["bytes"], validate=True))
    tensor = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return tensor.view(dtype).reshape(shape).to(device)


_ROLLOUT_TENSORS = ("advantages", "keep", "old_logps", "ref_logps", "behaviour_logps")


def encode_in_flight(batch: InFlight) -> dict[str, Any]:
    """``batch`` as JSON-ready values: its tensors as base64 of their raw bytes (exact)."""
    parts = []
    for part in batch.received():
        rollout = part.rollout
        parts.append(
            {
                "batch": {key: _encode_tensor(value) for key, value in rollout.batch.items()},
                **{key: _encode_tensor(getattr(rollout, key)) for key in _ROLLOUT_TENSORS},
                "records": part.records,
                "sums": part.sums,
            }
        )
    return {"step": batch.step, "behaviour_step": batch.behaviour_step, "parts": parts}


def decode_in_flight(record: dict[str, Any], device: torch.device) -> InFlight:
    """The batch :func:`encode_in_flight` wrote (tensors on ``device``).

    Raises:
        KeyError, ValueError, TypeError: The record is not one (the caller names the file).
    """
    parts = []
    for item in record["parts"]:
        tensors = {key: _decode_tensor(item[key], device) for key in _ROLLOUT_TENSORS}
        batch = {key: _decode_tensor(value, device) for key, value in item["batch"].items()}
        rollout = Rollout(batch, **tensors)
        sums = {str(key): float(value) for key, value in item["sums"].items()}
        parts.append(ScoredGroups(rollout, list(item["records"]), sums))
    return InFlight(int(record["step"]), int(record["behaviour_step"]), parts)
