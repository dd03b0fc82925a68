"""GRPO validation: greedy completions of a validation prompt set, scored with the rewards."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import DataLoader

from tunelab.errors import DataError
from tunelab.rl.rewards import Rewards
from tunelab.rl.rollout import ModelRolloutEngine
from tunelab.rl.step import exact_parts, global_sums, prompt_images

__all__ = ["RolloutValidation"]


class RolloutValidation:
    """Greedy completions of a validation prompt set, scored with the training rewards.

    Greedy decoding (temperature 0) draws no random numbers, so validating changes neither
    the training completions nor a resume. Every rank runs the same number of batches (the
    loader drops the tail).

    Args:
        engine: The training engine; validation uses a greedy copy of its settings.
        rewards: The reward functions.
        loader: The validation prompts' loader (``TrainingData.val_loader``): batches with
            ``index`` into its dataset (``tokens``, ``prompts`` and ``rows`` by index).
        decode: Token ids to text.
        device: For the global sums.
    """

    def __init__(
        self,
        engine: ModelRolloutEngine,
        rewards: Rewards,
        loader: DataLoader,
        *,
        decode: Any,
        device: torch.device,
    ) -> None:
        self.engine = ModelRolloutEngine(
            engine.model,
            replace(engine.settings, temperature=0.0),
            pad_id=engine.pad_id,
            decode=engine.decode,
            gather_once=engine.gather_once,
        )
        self.rewards, self.prompts, self.loader = rewards, loader.dataset, loader
        self.decode, self.device = decode, device

    def __call__(self) -> dict[str, float]:
        """``val_reward``, ``val_rewards/<name>`` and ``val_completion_length``: means.

        Raises:
            DataError: The validation set has fewer prompts than a batch per process.
        """
        sums: dict[str, float] = {}
        for batch in self.loader:
            indices = batch["index"].tolist()
            images = prompt_images(self.prompts, indices)
            completions = self.engine.generate(
                [self.prompts.tokens[i] for i in indices],
                [0] * len(indices),
                **({} if images is None else {"images": images}),
            )
            total, each = self.rewards(
                [self.prompts.prompts[i] for i in indices],
                [self.decode(c) for c in completions],
                [self.prompts.rows[i] for i in indices],
            )
            # Rewards as exact limbs: the same totals on any number of processes.
            limbs = exact_parts("reward", total)
            for name, values in each.items():
                limbs |= exact_parts(f"rewards/{name}", values)
            for key, value in {
                "count": len(indices),
                "completion_length": sum(len(c) for c in completions),
                **limbs,
            }.items():
                sums[key] = sums.get(key, 0.0) + value
        if not sums:  # the sampler gives every rank the same number of batches
            raise DataError(
                f"val_dataset has fewer than batch_size={self.loader.batch_size} prompts per "
                "process; lower batch_size or add validation prompts"
            )
        totals = global_sums(sums, self.device)
        count = totals.pop("count")
        return {f"val_{key}": value / count for key, value in totals.items()}
