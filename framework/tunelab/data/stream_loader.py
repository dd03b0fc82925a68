"""A streaming dataset over ranks: global batches split by rank, and their saved position.

Every rank reads the same global item stream (``StreamingDataset.items``). A micro-batch round
takes the next ``batch_size * W`` global items and rank ``r`` of ``W`` keeps items ``r, r + W,
...`` of them: the rule of ``StatefulDistributedSampler``, so an optimizer step of a global
batch ``G = W * batch_size * grad_accum`` always trains on global items ``[k * G, (k + 1) * G)``
whatever ``W`` is. The position after a step is the stream location after item ``(k + 1) * G``,
the same on every rank and at every world size.

``StreamPosition`` is the sampler's counterpart for ``TrainingData``: the recipe calls
``set_epoch``, ``advance`` and ``state_dict`` / ``load_state_dict`` the same way. Each
micro-batch the loader yields carries the location after it (``pending``); ``advance`` after the
step commits the location of the step's last micro-batch, so what the checkpoint saves is what
the training loop used, not what was read ahead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from tunelab.data.sampler import resumed_seed
from tunelab.data.streaming import LOCATION_KEYS, StreamingDataset, start_location
from tunelab.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


class StreamPosition:
    """Where a run is in its stream: epoch, global items used, and the next sample's location.

    Attributes:
        epoch: The current epoch (seeds the shuffle).
        consumed: Global items already used this epoch (advanced by the recipe).
        seed: The data seed.
        location: The first unused sample (``streaming.LOCATION_KEYS``).
        num_replicas: World size ``W``.
    """

    def __init__(self, *, num_sources: int, num_replicas: int, seed: int) -> None:
        self.num_sources = num_sources
        self.num_replicas = num_replicas
        self.seed = seed
        self.epoch = 0
        self.consumed = 0
        self.location = start_location()
        self.pending: tuple[int, dict[str, int]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``; the position resets only when the epoch changes."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0
            self.location = start_location()

    def samples_per_step(self, num_samples_per_rank: int) -> int:
        """Global items used when every rank uses ``num_samples_per_rank``."""
        return num_samples_per_rank * self.num_replicas

    def advance(self, num_samples_per_rank: int) -> None:
        """Commit the step just taken: its items are used, the stream goes on after them."""
        consumed = self.consumed + self.samples_per_step(num_samples_per_rank)
        assert self.pending is not None and self.pending[0] == consumed, (
            "advance() must follow the micro-batches of exactly one step"
        )
        self.consumed, self.location = consumed, self.pending[1]

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "consumed", "seed", "num_sources", "stream"}``: JSON, free of world size."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "num_sources": self.num_sources,
            "stream": dict(self.location),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a position saved at any world size.

        Raises:
            ConfigError: If the checkpoint was not saved by a streaming run, or the sources
                changed in number since.
        """
        if "stream" not in state_dict:
            raise ConfigError(
                "dataset.streaming: the checkpoint was saved by a run without streaming; "
                "resume it with the same dataset settings"
            )
        if int(state_dict["num_sources"]) != self.num_sources:
            raise ConfigError(
                f"dataset.streaming: the checkpoint's stream had {state_dict['num_sources']} "
                f"files, the dataset now has {self.num_sources}: was it changed?"
            )
        self.seed = resumed_seed(state_dict, self.seed)
        self.epoch = int(state_dict["epoch"])
        self.consumed = int(state_dict["consumed"])
        self.location = {key: int(state_dict["stream"][key]) for key in LOCATION_KEYS}


class StreamLoader:
    """This rank's micro-batches of a ``StreamingDataset``, from the committed position on.

    Args:
        dataset: The stream.
        position: The position it starts from and reports to.
        batch_size: Items per micro-batch on this rank.
        collate_fn: Turns a list of items into a batch of tensors.
        rank: This rank, in ``[0, W)``.
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        position: StreamPosition,
        *,
        batch_size: int,
        collate_fn: Callable[[list[dict]], dict],
        rank: int,
    ) -> None:
        self.dataset = dataset
        self.position = position
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.rank = rank

    def __iter__(self) -> Iterator[dict]:
        """Yield micro-batches; each records ``position.pending`` (items used, next location).

        Raises:
            DataError: If the sources end before the epoch's steps (all ranks at once).
        """
        position = self.position
        epoch, consumed = position.epoch, position.consumed
        items = self.dataset.items(epoch, position.seed, position.location)
        round_size = self.batch_size * position.num_replicas
        while True:
            group = list(islice(items, round_size))
            if len(group) < round_size:
                raise DataError(
                    f"dataset.streaming: the stream of epoch {epoch} ended after "
                    f"{consumed + len(group)} items, before the step's micro-batch of "
                    f"{round_size}: lower max_steps_per_epoch or add data"
                )
            consumed += round_size
            position.pending = (consumed, group[-1][1])
            yield self.collate_fn([item for item, _ in group[self.rank :: position.num_replicas]])
