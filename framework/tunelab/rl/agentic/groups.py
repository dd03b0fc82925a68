"""GRPO's rollout phase with episodes: G episodes per prompt, scored on the whole episode.

:class:`EpisodeGroupSampler` is a :class:`~tunelab.rl.GroupSampler` whose completions are
episodes (:class:`~tunelab.rl.agentic.EpisodeRunner`): the rest of the GRPO step (advantages,
dynamic sampling and refills, the loss passes, metrics, checkpoints) is unchanged. Each
episode's seed is its sampling seed (the run's seed, the step, the prompt's index and the
generation), which also seeds its environment, so a resumed run replays the same episodes,
tool calls and results included.

The rewards see the whole episode: each reward function is called with ``completions`` = the
episode's final answer (the last reply's content) and ``rows`` = the prompt's row with an
``episode`` key (its messages with roles, tool calls and results, turns, tool errors,
environment reward). The environment's ``reward()`` joins the total with
``agentic.environment_reward_weight`` (``rewards/environment``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tunelab.config.sections import RolloutArgs
from tunelab.data.conversations import read_part
from tunelab.data.rows import BadRow
from tunelab.errors import ConfigError, DataError
from tunelab.rl.advantages import Completions, GroupSampler
from tunelab.rl.agentic.episodes import STOP_REASONS, Episode, EpisodeRunner, episode_batch
from tunelab.rl.agentic.tools import ERROR_KINDS
from tunelab.rl.rewards import Rewards
from tunelab.rl.step import behaviour_logps_batch

__all__ = ["EpisodeGroupSampler", "episode_sums"]


class EpisodeGroupSampler(GroupSampler):
    """Samples ``num_generations`` episodes per prompt, scores them, computes advantages.

    Args:
        runner: Rolls the episodes out.
        rewards: The reward functions.
        prompts: The prompt dataset (``rows`` by index).
        prompt_column: The rows' prompt column (a string or a list of messages).
        environment_weight: Weight of the environment's reward in the total.
        **settings: ``GroupSampler``'s keyword settings.
    """

    def __init__(
        self,
        runner: EpisodeRunner,
        rewards: Rewards,
        prompts: Any,
        *,
        prompt_column: str,
        environment_weight: float,
        **settings: Any,
    ) -> None:
        super().__init__(None, rewards, prompts, **settings)  # type: ignore[arg-type]
        self.runner = runner
        self.prompt_column = prompt_column
        self.environment_weight = environment_weight

    @classmethod
    def from_runner(
        cls,
        runner: EpisodeRunner,
        rewards: Rewards,
        prompts: Any,
        rollout: RolloutArgs,
        *,
        seed: int,
        device: torch.device,
    ) -> EpisodeGroupSampler:
        """The rollout phase of the ``rollout`` section with ``runner``'s episodes.

        Args:
            runner: ``EpisodeRunner.from_settings`` (the ``agentic`` section: its
                ``prompt_column`` and ``environment_reward_weight`` are read here).
            rewards: The reward functions (with the ``rewards`` section's ``scale``).
            prompts: The prompt dataset.
            rollout: The ``rollout`` settings (``num_generations``, ``dynamic_sampling``).
            seed: The run's seed.
            device: Where rollout batches go.

        Raises:
            ConfigError: The prompts hold images (episodes do not read them yet).
        """
        if getattr(prompts, "images", None) is not None:
            raise ConfigError(
                "agentic: the dataset's prompts hold images, which agentic episodes do not "
                "read yet; use grpo_distributed without the agentic section for image prompts"
            )
        agentic = runner.settings
        return cls(
            runner,
            rewards,
            prompts,
            prompt_column=agentic.prompt_column,
            environment_weight=agentic.environment_reward_weight,
            decode=runner.tokenizer.decode,
            pad_id=runner.sampler.pad_id,
            num_generations=rollout.num_generations,
            seed=seed,
            scale_rewards=rewards.scale,
            dynamic_sampling=rollout.dynamic_sampling,
            device=device,
        )

    def _messages(self, index: int) -> list[dict[str, Any]]:
        row = self.prompts.rows[index]
        try:
            return read_part(row.get(self.prompt_column), self.prompt_column, "user")
        except BadRow as bad:
            raise DataError(f"prompt row {index}: {bad.column}: {bad.problem}") from None

    def complete(self, repeated: list[int], seeds: list[int]) -> Completions:
        """Roll out one episode per entry of ``repeated`` (dataset indices), each from its seed."""
        data = self.prompts
        episodes = self.runner.run([(self._messages(i), data.rows[i]) for i in repeated], seeds)
        timings = self.runner.last_metrics
        batch = episode_batch(episodes, self.pad_id, self.device)
        # The behaviour log-probs along each episode (tool tokens 0.0, masked by the labels):
        # the off-policy correction and metrics read them as a single-turn rollout's.
        behaviour = None
        if episodes and all(e.logps is not None for e in episodes):
            behaviour = behaviour_logps_batch(
                [e.prompt_tokens for e in episodes], [e.logps for e in episodes],
                batch["tokens"].shape[1], self.device,
            )  # fmt: skip
        extra_rewards = {}
        if any(e.environment_reward is not None for e in episodes):
            environment = [e.environment_reward or 0.0 for e in episodes]
            extra_rewards["environment"] = (
                self.environment_weight,
                torch.tensor(environment, dtype=torch.float64),
            )
        return Completions(
            texts=[_answer(episode) for episode in episodes],
            rows=[
                dict(data.rows[i], episode=e.record())
                for i, e in zip(repeated, episodes, strict=True)
            ],
            batch=batch,
            lengths=torch.tensor([sum(e.trained) for e in episodes], dtype=torch.float64),
            records=[
                {**e.record(), "completion_ids": e.tokens, "trained": e.trained} for e in episodes
            ],
            sums={
                "generation_seconds": timings["generation_seconds"],
                "entropy": timings["entropy_sum"],
                **episode_sums(episodes, timings),
            },
            extra_rewards=extra_rewards,
            behaviour_logps=behaviour,
        )


def _answer(episode: Episode) -> str:
    replies = [m for m in episode.messages if m.get("role") == "assistant"]
    return str(replies[-1].get("content") or "") if replies else ""


def episode_sums(episodes: list[Episode], timings: Mapping[str, float]) -> dict[str, float]:
    """The episodes' sums for the step's ``agentic/*`` metrics (per episode once averaged).

    ``agentic/turns``, ``agentic/tool_calls``, ``agentic/tool_errors/<kind>`` (every kind, 0
    included), ``agentic/tool_results_cut`` (results cut to the agentic limits), ``agentic/tool_seconds`` (time inside tools), ``agentic/generation_seconds`` and
    ``agentic/tools_wall_seconds`` (the rollout's wall time in generation and in tools),
    ``agentic/prefill_tokens`` (tokens the KV cache prefilled: prompts and tool deltas, never
    the conversation again), and ``agentic/stop/<reason>``.
    """
    sums = {
        "agentic/turns": float(sum(e.num_turns for e in episodes)),
        "agentic/tool_calls": float(sum(e.num_tool_calls for e in episodes)),
        "agentic/tool_results_cut": float(sum(e.tool_results_cut for e in episodes)),
        "agentic/tool_seconds": float(sum(e.tool_seconds for e in episodes)),
        "agentic/generation_seconds": timings["generation_seconds"] * len(episodes),
        "agentic/tools_wall_seconds": timings["tool_seconds"] * len(episodes),
        "agentic/prefill_tokens": timings["prefill_tokens"],
    }
    for kind in ERROR_KINDS:
        sums[f"agentic/tool_errors/{kind}"] = float(sum(e.tool_errors[kind] for e in episodes))
    for reason in STOP_REASONS:  # every key on every rank: the sums are one all-reduce
        sums[f"agentic/stop/{reason}"] = float(sum(e.stop_reason == reason for e in episodes))
    return sums
