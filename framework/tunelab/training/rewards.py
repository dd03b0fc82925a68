"""Verifiable rewards for GRPO: plain functions named in the config, scored per completion.

A reward is any Python callable ``(prompts, completions, rows, **settings) -> list[float]``:
``prompts`` and ``completions`` are the decoded texts of a batch of rollouts, ``rows`` the
dataset rows they came from (every column, e.g. ``answer``), one per completion. The config
names it as a component whose other keys are its settings::

    rewards:
      - _component_: tunelab.training.exact_answer_reward
        column: answer
      - _component_: my_rewards.brevity      # your own function, on PYTHONPATH
        limit: 40
    reward_weights: [1.0, 0.5]

:class:`Rewards` calls each one, checks what it returned (one finite float per completion),
and sums them with their weights; each one's mean is logged under ``rewards/<name>``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from omegaconf import DictConfig

from tunelab.config import instantiate
from tunelab.errors import ConfigError

__all__ = [
    "Rewards",
    "completion_length_reward",
    "exact_answer_reward",
    "math_verify_reward",
    "regex_reward",
]


def _normalise(text: str) -> str:
    return " ".join(text.split()).strip()


def exact_answer_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[dict[str, Any]],
    *,
    column: str = "answer",
    normalise_whitespace: bool = True,
) -> list[float]:
    """1.0 where the completion equals the row's answer, else 0.0.

    Args:
        prompts: The prompts (unused).
        completions: The completions.
        rows: The dataset rows; ``rows[i][column]`` is completion ``i``'s answer.
        column: The answer column.
        normalise_whitespace: Compare with runs of whitespace collapsed and the ends stripped.

    Returns:
        One reward per completion.
    """
    scores = []
    for completion, row in zip(completions, rows, strict=True):
        if column not in row:
            raise KeyError(f"the row has no column {column!r} (it has {sorted(row)})")
        answer = str(row[column])
        if normalise_whitespace:
            completion, answer = _normalise(completion), _normalise(answer)
        scores.append(1.0 if completion == answer else 0.0)
    return scores


def regex_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[dict[str, Any]],
    *,
    pattern: str,
    full_match: bool = True,
) -> list[float]:
    """1.0 where the completion matches ``pattern`` (a format reward), else 0.0.

    Args:
        prompts: The prompts (unused).
        completions: The completions.
        rows: The dataset rows (unused).
        pattern: A Python regular expression (``re`` syntax, DOTALL).
        full_match: The whole completion must match (else a match anywhere counts).

    Returns:
        One reward per completion.
    """
    compiled = re.compile(pattern, re.DOTALL)
    match = compiled.fullmatch if full_match else compiled.search
    return [1.0 if match(completion.strip()) else 0.0 for completion in completions]


def completion_length_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[dict[str, Any]],
    *,
    max_chars: int,
    penalty_per_char: float = 0.01,
) -> list[float]:
    """A penalty for length beyond ``max_chars``: ``-penalty_per_char * max(0, len - max_chars)``.

    Args:
        prompts: The prompts (unused).
        completions: The completions.
        rows: The dataset rows (unused).
        max_chars: Characters a completion may have without penalty.
        penalty_per_char: Penalty per character beyond it.

    Returns:
        One reward (0 or negative) per completion.
    """
    return [-penalty_per_char * max(0, len(c.strip()) - max_chars) for c in completions]


def math_verify_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[dict[str, Any]],
    *,
    column: str = "answer",
    answer_after: str | None = None,
) -> list[float]:
    r"""1.0 where the completion's final answer equals the row's mathematically, else 0.0.

    Both are parsed with Hugging Face's ``math-verify`` (``pip install 'tunelab[math]'``):
    LaTeX, ``\boxed{}``, fractions, sets and plain numbers compare by value, so ``1/2``,
    ``0.5`` and ``\frac{1}{2}`` are the same answer.

    Args:
        prompts: The prompts (unused).
        completions: The completions.
        rows: The dataset rows; ``rows[i][column]`` holds the gold answer.
        column: The gold answer's column.
        answer_after: Take the gold answer after the last occurrence of this marker (GSM8K's
            ``####``); None: the whole cell.

    Returns:
        One reward per completion (0.0 when either side does not parse).

    Raises:
        ImportError: ``math-verify`` is not installed.
    """
    try:
        from math_verify import parse, verify  # optional: only this reward needs it
    except ImportError as error:
        raise ImportError(
            "math_verify_reward needs the math-verify package: pip install 'tunelab[math]'"
        ) from error
    scores = []
    for completion, row in zip(completions, rows, strict=True):
        gold = str(row[column])
        if answer_after is not None:
            gold = gold.rsplit(answer_after, 1)[-1]
        gold_parsed, answer_parsed = parse(gold.strip()), parse(completion)
        ok = bool(gold_parsed) and bool(answer_parsed) and verify(gold_parsed, answer_parsed)
        scores.append(1.0 if ok else 0.0)
    return scores


def _name_of(node: Any, index: int) -> str:
    target = node.get("_component_") if isinstance(node, (dict, DictConfig)) else None
    return str(target).rsplit(".", 1)[-1] if target else f"reward_{index}"


class Rewards:
    """The configured reward functions with their weights.

    Args:
        nodes: The ``rewards`` component nodes, each called with ``prompts``, ``completions``
            and ``rows`` (and its own settings).
        weights: One weight per reward (None: all 1.0).

    Raises:
        ConfigError: No reward, or a number of weights that does not match.
    """

    def __init__(self, nodes: Sequence[Any], weights: Sequence[float] | None = None) -> None:
        if not nodes:
            raise ConfigError("rewards: give at least one reward function")
        weights = list(weights) if weights is not None else [1.0] * len(nodes)
        if len(weights) != len(nodes):
            raise ConfigError(
                f"reward_weights: {len(weights)} weights for {len(nodes)} rewards; give one each"
            )
        self.nodes = list(nodes)
        self.weights = weights
        names = [_name_of(node, i) for i, node in enumerate(self.nodes)]
        # Two rewards of one function (with other settings) get their index appended.
        self.names = [
            f"{name}_{i}" if names.count(name) > 1 else name for i, name in enumerate(names)
        ]

    def __call__(
        self, prompts: list[str], completions: list[str], rows: list[dict[str, Any]]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score completions with every reward.

        Args:
            prompts: One prompt text per completion.
            completions: The completion texts.
            rows: One dataset row per completion.

        Returns:
            ``(total, each)``: the weighted sum ``[completions]`` (fp64) and each reward's
            unweighted values by name.

        Raises:
            ConfigError: A reward raised, or did not return one finite number per completion;
                the message names it.
        """
        each = {}
        for node, name in zip(self.nodes, self.names, strict=True):
            try:
                values = instantiate(node, prompts=prompts, completions=completions, rows=rows)
            except ConfigError:
                raise
            except Exception as error:  # a user's function may raise anything: name it
                raise ConfigError(
                    f"reward {name} raised {type(error).__name__}: {error}"
                ) from error
            each[name] = _checked(values, len(completions), name)
        total = sum(
            weight * values for weight, values in zip(self.weights, each.values(), strict=True)
        )
        return total, each


def _checked(values: Any, expected: int, name: str) -> torch.Tensor:
    try:
        values = [float(value) for value in values]
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"reward {name} must return a list of numbers, got {type(values).__name__} ({error})"
        ) from None
    if len(values) != expected:
        raise ConfigError(
            f"reward {name} returned {len(values)} values for {expected} completions; "
            "return one per completion"
        )
    if not all(math.isfinite(value) for value in values):
        raise ConfigError(f"reward {name} returned a value that is not finite: {values}")
    return torch.tensor(values, dtype=torch.float64)
