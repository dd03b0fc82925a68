"""A distributed sampler whose position is saved and restored at any world size.

Each epoch draws one global permutation ``perm`` of the dataset, seeded by ``seed + epoch``
(the same on every rank). The sampler counts ``consumed``, the global samples already used this
epoch. Rank ``r`` of ``W`` yields ``perm[consumed + r], perm[consumed + r + W], ...``: the
global order is read in rounds of ``W`` samples, one per rank. So for a global batch of ``G``
samples per optimizer step (``G = W * micro_batch * grad_accum``) a step always uses
``perm[k * G : (k + 1) * G]`` whatever ``W`` is: world sizes 1 and 2 train on the same samples
per step, and a state saved at one world size resumes exactly at another. Every rank yields
``(N - consumed) // W`` samples; the remainder, fewer than ``W``, is dropped so that no rank
waits on a collective the others skip.

How a recipe keeps the position (``DataLoader`` workers prefetch, so the sampler cannot know
what the training loop has used):

    sampler.set_epoch(epoch)                    # resets consumed when the epoch changes
    step_in_epoch = sampler.consumed // sampler.samples_per_step(batch_size * grad_accum)
    for batch in dataloader:                    # iteration starts at the saved ``consumed``
        ...optimizer step...
        sampler.advance(batch_size * grad_accum)  # this rank's samples; counts all ranks
        save: sampler.state_dict()              # {"epoch", "consumed", "seed"}

and on resume ``sampler.load_state_dict(state)`` before building the iterator. Build the
``DataLoader`` with ``drop_last=True`` so every step has full micro-batches.
"""

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from tunelab.errors import ConfigError

logger = logging.getLogger(__name__)


def resumed_seed(state_dict: dict[str, Any], configured: int) -> int:
    """The data seed a resume continues with: the checkpoint's, said when it differs."""
    saved = int(state_dict["seed"])
    if saved != configured:
        logger.warning(
            "resuming with the checkpoint's data seed %s, not the configured %s", saved, configured
        )
    return saved


class StatefulDistributedSampler(Sampler[int]):
    """Seeded, strided distributed sampler with an exact, world-size-free resume position.

    Attributes:
        epoch: The current epoch (seeds the permutation).
        consumed: Global samples already used this epoch (advanced by the recipe).
        seed: Base seed of the permutations.
    """

    def __init__(
        self, dataset_len: int, *, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0
    ) -> None:
        """Create the sampler at epoch 0, position 0.

        Args:
            dataset_len: Number of items in the dataset.
            num_replicas: World size ``W`` (data-parallel ranks).
            rank: This rank, in ``[0, W)``.
            shuffle: Permute each epoch; otherwise read in order.
            seed: Base seed; epoch ``e`` uses ``seed + e``.

        Raises:
            ConfigError: If the sizes or the rank are out of range.
        """
        if dataset_len < 0 or num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ConfigError(
                f"sampler needs dataset_len >= 0, num_replicas >= 1 and 0 <= rank < "
                f"num_replicas; got {dataset_len}, {num_replicas}, {rank}"
            )
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.consumed = 0

    def _permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=generator)

    def __len__(self) -> int:
        """Samples this rank yields from the current position to the end of the epoch."""
        return max(self.dataset_len - self.consumed, 0) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices from ``consumed`` on.

        The start is a snapshot: ``advance`` during iteration moves the saved position, not
        this iterator.
        """
        start = self.consumed + self.rank
        stop = self.consumed + len(self) * self.num_replicas
        yield from self._permutation()[start : stop : self.num_replicas].tolist()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``; the position resets only when the epoch changes.

        So calling ``set_epoch`` with the epoch restored by ``load_state_dict`` keeps the
        restored position.
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    def samples_per_step(self, num_samples_per_rank: int) -> int:
        """Global samples used when every rank uses ``num_samples_per_rank``.

        Args:
            num_samples_per_rank: Samples one rank uses per optimizer step
                (``micro_batch * grad_accum``).

        Returns:
            ``num_samples_per_rank * num_replicas``.
        """
        return num_samples_per_rank * self.num_replicas

    def advance(self, num_samples_per_rank: int) -> None:
        """Record that every rank used ``num_samples_per_rank`` more samples.

        ``consumed`` (global) grows by ``num_samples_per_rank * num_replicas``: rank ``r`` used
        the samples at offsets ``r, r + W, ...`` of that window of the global order.

        Args:
            num_samples_per_rank: Samples this rank used since the last call, e.g.
                ``micro_batch * grad_accum`` per optimizer step.
        """
        consumed = self.consumed + self.samples_per_step(num_samples_per_rank)
        self.consumed = min(consumed, self.dataset_len)

    def state_dict(self) -> dict[str, int]:
        """Return ``{"epoch", "consumed", "seed"}``: the position, free of world size."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore a position saved at any world size.

        The saved seed wins over the configured one (with a warning when they differ): the
        permutation must be the one the saved position counts into.

        Args:
            state_dict: As returned by ``state_dict``.

        Raises:
            ConfigError: If a key is missing or ``consumed`` exceeds the dataset length.
        """
        if "stream" in state_dict:
            raise ConfigError(
                "dataset.streaming: the checkpoint was saved by a streaming run; resume it with "
                "streaming: true"
            )
        missing = {"epoch", "consumed", "seed"} - set(state_dict)
        if missing:
            raise ConfigError(f"sampler state is missing {', '.join(sorted(missing))}")
        consumed = int(state_dict["consumed"])
        if not 0 <= consumed <= self.dataset_len:
            raise ConfigError(
                f"sampler state has consumed={consumed} but the dataset has {self.dataset_len} "
                "items: was the dataset changed since the checkpoint?"
            )
        self.seed = resumed_seed(state_dict, self.seed)
        self.epoch = int(state_dict["epoch"])
        self.consumed = consumed
