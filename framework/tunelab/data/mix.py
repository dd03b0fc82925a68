"""Weighted mixing of several datasets into one epoch.

``mix_dataset`` draws a fixed epoch of ``num_samples`` items (default: the datasets' total
length) from its datasets, in proportion to their weights, deterministically from ``seed``:

1. Dataset ``k`` gets ``n_k`` items, the weights' share of ``num_samples`` rounded by largest
   remainder (ties to the earlier dataset), so the counts add up to ``num_samples`` exactly.
2. Its items are read in seeded random orders: a permutation of the whole dataset, then
   another when ``n_k`` exceeds its length (a dataset is upsampled by repeating whole passes,
   each item at most once per pass), cut at ``n_k`` (downsampled: a seeded subset).
3. The drawn items of all datasets are interleaved by one more seeded permutation.

The draw is the same on every rank and in every run with the same seed. It is drawn once: each
epoch reads the same mixture, in the order the sampler shuffles (``seed + epoch``), so a
downsampled dataset contributes the same subset every epoch.

In a config the datasets are nested nodes without a tokenizer (builders called without one
return a ``DatasetSpec``), and the recipe's tokenizer reaches them through ``mix_dataset``::

    dataset:
      _component_: tunelab.data.mix_dataset
      weights: [0.7, 0.3]
      datasets:
        - _component_: tunelab.data.chat_dataset
          source: data/chat.jsonl
        - _component_: tunelab.data.instruct_dataset
          source: data/alpaca.jsonl
          template: auto
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tunelab.data.streaming import StreamingDataset
from tunelab.errors import ConfigError


@dataclass
class DatasetSpec:
    """A dataset builder and its arguments, waiting for a tokenizer.

    Attributes:
        builder: The builder (``chat_dataset``, ...).
        kwargs: Its arguments, but the tokenizer.
    """

    builder: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def capture(cls, builder: Callable[..., Any], arguments: Mapping[str, Any]) -> DatasetSpec:
        """A spec from a builder's ``locals()`` at its start (its parameters)."""
        kwargs = {key: value for key, value in arguments.items() if key != "tokenizer"}
        kwargs.update(kwargs.pop("load_dataset_kwargs", {}))
        return cls(builder, kwargs)

    def build(self, tokenizer: Any) -> Any:
        """Build the dataset with ``tokenizer``."""
        return self.builder(tokenizer, **self.kwargs)


def _counts(weights: Sequence[float], num_samples: int) -> list[int]:
    """Largest-remainder shares of ``num_samples`` in proportion to ``weights``."""
    total = sum(weights)
    exact = [weight / total * num_samples for weight in weights]
    counts = [math.floor(share) for share in exact]
    by_remainder = sorted(range(len(exact)), key=lambda k: (counts[k] - exact[k], k))
    for k in by_remainder[: num_samples - sum(counts)]:
        counts[k] += 1
    return counts


def _draw(length: int, count: int, generator: torch.Generator) -> np.ndarray:
    """``count`` indices into ``range(length)``: whole seeded passes, the last one cut."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    passes = [torch.randperm(length, generator=generator) for _ in range(-(-count // length))]
    return torch.cat(passes)[:count].numpy()


class MixedDataset(Dataset):
    """Items drawn from several datasets by weight (see the module docstring).

    Attributes:
        datasets: The mixed datasets.
        counts: Items drawn from each, per epoch.
        num_skipped: Malformed rows skipped, summed over the datasets.
        num_truncated: Samples cut to ``max_seq_len``, summed.
        num_dropped: Preference pairs dropped, summed.
        packed: Whether items are packs.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float],
        *,
        num_samples: int | None = None,
        seed: int = 0,
    ) -> None:
        """Draw the mixture.

        Args:
            datasets: Built datasets (map-style, of one kind of item).
            weights: One non-negative weight per dataset; they need not sum to 1.
            num_samples: Items per epoch (default: the datasets' total length).
            seed: Seed of the draw.

        Raises:
            ConfigError: For mismatched lengths, bad weights, or datasets of different kinds.
        """
        if len(datasets) != len(weights) or not datasets:
            raise ConfigError(
                f"mix_dataset needs one weight per dataset: {len(datasets)} datasets, "
                f"{len(weights)} weights"
            )
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"mix_dataset weights must be >= 0 and not all 0, got {weights}")
        kinds = {(getattr(d, "kind", "sft"), bool(getattr(d, "packed", False))) for d in datasets}
        if len(kinds) > 1:
            raise ConfigError(
                "mix_dataset: all datasets must give the same kind of item (SFT or preference, "
                "all packed or none)"
            )
        total = sum(len(dataset) for dataset in datasets)
        num_samples = total if num_samples is None else num_samples
        if num_samples < 1:
            raise ConfigError(f"mix_dataset num_samples must be at least 1, got {num_samples}")
        self.datasets = list(datasets)
        self.counts = _counts([float(w) for w in weights], num_samples)
        empty = [k for k, count in enumerate(self.counts) if count and not len(datasets[k])]
        if empty:
            raise ConfigError(f"mix_dataset: dataset {empty[0]} has no items but a weight")
        generator = torch.Generator().manual_seed(seed)
        draws = [
            _draw(len(dataset), count, generator)
            for dataset, count in zip(self.datasets, self.counts)
        ]
        which = np.concatenate([np.full(n, k, dtype=np.int16) for k, n in enumerate(self.counts)])
        order = torch.randperm(num_samples, generator=generator).numpy()
        self._which = which[order]
        self._index = np.concatenate(draws).astype(np.int64)[order]
        self.num_skipped = sum(getattr(d, "num_skipped", 0) for d in datasets)
        self.num_truncated = sum(getattr(d, "num_truncated", 0) for d in datasets)
        self.num_dropped = sum(getattr(d, "num_dropped", 0) for d in datasets)
        self.kind, self.packed = next(iter(kinds))

    def num_longer_than(self, length: int) -> int:
        """Rows of the mixed datasets with more than ``length`` tokens, summed."""
        return sum(
            d.num_longer_than(length) for d in self.datasets if hasattr(d, "num_longer_than")
        )

    def __len__(self) -> int:
        """Items per epoch: ``num_samples``."""
        return len(self._index)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Item ``index`` of the mixture."""
        return self.datasets[int(self._which[index])][int(self._index[index])]


def mix_dataset(
    tokenizer: Any = None,
    *,
    datasets: Sequence[Any],
    weights: Sequence[float],
    num_samples: int | None = None,
    seed: int = 0,
) -> MixedDataset | DatasetSpec:
    """Mix datasets by weight (see the module docstring for the sampling).

    Args:
        tokenizer: The tokenizer (passed by the recipe); builds each ``DatasetSpec``. None
            (a mixture nested in another): return a ``DatasetSpec``.
        datasets: Dataset nodes (``DatasetSpec``s, as a config's nested nodes give) or built
            datasets.
        weights: One weight per dataset, >= 0; the proportions of the mixture.
        num_samples: Items per epoch (default: the sum of the datasets' lengths).
        seed: Seed of the draw (the same on every rank).

    Returns:
        The mixture.

    Raises:
        ConfigError: For mismatched lengths, bad weights, or mixed kinds of item.
    """
    if tokenizer is None and any(isinstance(d, DatasetSpec) for d in datasets):
        return DatasetSpec.capture(mix_dataset, locals())
    built = [d.build(tokenizer) if isinstance(d, DatasetSpec) else d for d in datasets]
    streamed = [k for k, dataset in enumerate(built) if isinstance(dataset, StreamingDataset)]
    if streamed:
        raise ConfigError(
            f"mix_dataset: datasets[{streamed[0]}].streaming: a stream cannot be mixed (the "
            "weights need each dataset's length); remove streaming"
        )
    return MixedDataset(built, list(weights), num_samples=num_samples, seed=seed)
