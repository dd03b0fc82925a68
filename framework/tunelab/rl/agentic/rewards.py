"""Rewards that read the whole episode (``rows[i]["episode"]``, see ``EpisodeGroupSampler``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["tool_call_reward"]


def tool_call_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[dict[str, Any]],
    *,
    failed_call: float = 0.5,
) -> list[float]:
    """A format reward for tool use: 1.0 when the episode made a call that succeeded.

    Args:
        prompts: The prompts (unused).
        completions: The final answers (unused).
        rows: The rows, each with its ``episode`` record.
        failed_call: The reward of an episode whose calls all failed (an unknown tool, bad
            arguments, an exception or a timeout): it wrote a call at least.

    Returns:
        1.0, ``failed_call`` or 0.0 (no call) per episode.
    """
    rewards = []
    for row in rows:
        episode = row["episode"]
        calls, errors = episode["num_tool_calls"], sum(episode["tool_errors"].values())
        rewards.append(1.0 if calls > errors else failed_call if calls else 0.0)
    return rewards
