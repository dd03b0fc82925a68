"""Verifiable rewards for GRPO: plain functions named in the config, scored per completion.

A reward is any Python callable ``(prompts, completions, rows, **settings) -> list[float]``:
``prompts`` and ``completions`` are the decoded texts of a batch of rollouts, ``rows`` the
dataset rows they came from (every column, e.g. ``answer``), one per completion. The config
names it as a component whose other keys are its settings::

    rewards:
      - _component_: tunelab.rl.exact_answer_reward
        column: answer
      - _component_: my_rewards.brevity      # your own function, on PYTHONPATH
        limit: 40
    reward_weights: [1.0, 0.5]

:class:`Rewards` calls each one under a time limit (``rewards.timeout_s``), checks what it
returned (one number per completion, finite and at most :data:`MAX_REWARD` in magnitude; text
is refused, not converted), and sums them with their weights; each one's mean is logged under
``rewards/<name>``.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch
from omegaconf import DictConfig

from tunelab.config import instantiate
from tunelab.config.sections import RewardArgs
from tunelab.errors import ConfigError, TrainingError

__all__ = [
    "MAX_REWARD",
    "Rewards",
    "completion_length_reward",
    "exact_answer_reward",
    "math_verify_reward",
    "regex_reward",
]


MAX_REWARD = 1e150
"""The largest reward magnitude taken, for each reward and for their weighted sum.

The step's metrics sum the squares of every completion's reward (``reward_std``) and each group's
advantages divide by its std: a reward of 1e155 squares to 1e310, past float64's 1.8e308, and
the statistics become inf or NaN far from the reward that caused it. Up to 1e150 the squares
stay below 1e300, so even 1e8 completions sum to a finite number.
"""


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
        timeout_s: Seconds one reward call may take (None: no limit); see :meth:`__call__`.
        scale: Whether each group's centred rewards are divided by their std (GRPO, DAPO;
            False for Dr. GRPO); read by ``GroupSampler.from_settings``.

    Raises:
        ConfigError: No reward, or a number of weights that does not match.
    """

    def __init__(
        self,
        nodes: Sequence[Any],
        weights: Sequence[float] | None = None,
        *,
        timeout_s: float | None = 60.0,
        scale: bool = True,
    ) -> None:
        self.scale = scale
        if not nodes:
            raise ConfigError("rewards: give at least one reward function")
        weights = list(weights) if weights is not None else [1.0] * len(nodes)
        if len(weights) != len(nodes):
            raise ConfigError(
                f"reward_weights: {len(weights)} weights for {len(nodes)} rewards; give one each"
            )
        self.nodes = list(nodes)
        self.weights = weights
        self.timeout_s = timeout_s
        names = [_name_of(node, i) for i, node in enumerate(self.nodes)]
        # Two rewards of one function (with other settings) get their index appended.
        self.names = [
            f"{name}_{i}" if names.count(name) > 1 else name for i, name in enumerate(names)
        ]

    @classmethod
    def from_settings(cls, rewards: RewardArgs) -> Rewards:
        """The rewards a recipe's ``rewards`` section describes, taken whole.

        Its ``scale`` (divide each group's centred rewards by their std) goes with them, for
        ``GroupSampler.from_settings``.
        """
        return cls(
            rewards.functions, rewards.weights, timeout_s=rewards.timeout_s, scale=rewards.scale
        )

    def __call__(
        self, prompts: list[str], completions: list[str], rows: list[dict[str, Any]]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score completions with every reward.

        Each reward runs in a thread of its own, waited on for ``timeout_s``: a reward that
        hangs (a stuck sandbox, a network call) ends the run with one line naming it and the
        rank, instead of every other rank waiting in the next collective until
        ``collective_timeout_s``. The thread is a daemon, so the hung call does not keep the
        process from exiting.

        Args:
            prompts: One prompt text per completion.
            completions: The completion texts.
            rows: One dataset row per completion.

        Returns:
            ``(total, each)``: the weighted sum ``[completions]`` (fp64) and each reward's
            unweighted values by name.

        Raises:
            ConfigError: A reward raised, or did not return one number per completion (text
                is refused), or returned a value that is not finite or larger than
                :data:`MAX_REWARD`, or the weighted sum is; the message names the reward.
            TrainingError: A reward did not return within ``timeout_s``.
        """
        each = {}
        for node, name in zip(self.nodes, self.names, strict=True):
            values = self._call(node, name, prompts, completions, rows)
            each[name] = _checked(values, len(completions), name)
        total = sum(
            weight * values for weight, values in zip(self.weights, each.values(), strict=True)
        )
        if not bool((total.abs() <= MAX_REWARD).all()):
            terms = " + ".join(f"{w:g} x {n}" for w, n in zip(self.weights, each, strict=True))
            raise ConfigError(
                f"the weighted reward {terms} reached {_largest(total)}: beyond +-{MAX_REWARD:g} "
                "its square overflows float64 in reward_std and the advantages; scale the "
                "rewards or reward_weights down"
            )
        return total, each

    def _call(
        self,
        node: Any,
        name: str,
        prompts: list[str],
        completions: list[str],
        rows: list[dict[str, Any]],
    ) -> Any:
        """Call one reward under the time limit; its exception or its values."""
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["values"] = instantiate(
                    node, prompts=prompts, completions=completions, rows=rows
                )
            except BaseException as error:  # handed to the caller's thread below
                outcome["error"] = error

        if self.timeout_s is None:
            target()
        else:
            # A daemon thread: a reward that never returns must not hold the process at exit.
            thread = threading.Thread(target=target, name=f"reward {name}", daemon=True)
            thread.start()
            thread.join(self.timeout_s)
            if thread.is_alive():
                raise TrainingError(
                    f"reward {name} did not return within rewards.timeout_s={self.timeout_s:g} s "
                    f"on rank {_rank()} (scoring {len(completions)} completions); fix the "
                    "reward, or raise rewards.timeout_s if it is only slow"
                )
        error = outcome.get("error")
        if isinstance(error, ConfigError) or (
            error is not None and not isinstance(error, Exception)
        ):  # a ConfigError names its own problem; Ctrl-C and exits stay what they are
            raise error
        if error is not None:  # a user's function may raise anything: name it
            raise ConfigError(f"reward {name} raised {type(error).__name__}: {error}") from error
        return outcome.get("values")


def _rank() -> int:
    # The rank torchrun gives this process (0 when started by hand); no collective needed.
    return int(os.environ.get("RANK", "0"))


def _largest(values: torch.Tensor) -> str:
    finite = values[torch.isfinite(values)]
    if finite.numel() < values.numel():
        return str(float(values[~torch.isfinite(values)][0]))
    return f"{float(finite.abs().max()):g}"


def _checked(values: Any, expected: int, name: str) -> torch.Tensor:
    """One float64 tensor of a reward's values, or a ``ConfigError`` naming the reward."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ConfigError(
            f"reward {name} must return a list of numbers, got {type(values).__name__}"
        )
    values = list(values)
    if len(values) != expected:
        raise ConfigError(
            f"reward {name} returned {len(values)} values for {expected} completions; "
            "return one per completion"
        )
    numbers = []
    for index, value in enumerate(values):
        # Text is refused rather than parsed: "1" and "0" from a reward are almost always a
        # completion or an answer column returned by mistake, not a score.
        if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
            raise ConfigError(
                f"reward {name} returned {type(value).__name__} {value!r:.40} for completion "
                f"{index}; return numbers (float), one per completion"
            )
        try:
            numbers.append(float(value))
        except (TypeError, ValueError) as error:  # a tensor of several elements, say
            raise ConfigError(
                f"reward {name} returned {type(value).__name__} for completion {index}, not one "
                f"number ({error})"
            ) from None
    for index, number in enumerate(numbers):
        if not math.isfinite(number):
            raise ConfigError(
                f"reward {name} returned a value that is not finite ({number} for completion "
                f"{index})"
            )
        if abs(number) > MAX_REWARD:
            raise ConfigError(
                f"reward {name} returned {number:g} for completion {index}: beyond "
                f"+-{MAX_REWARD:g} its square overflows float64 in reward_std and the "
                "advantages; scale it down (rewards of order 1 train best)"
            )
    return torch.tensor(numbers, dtype=torch.float64)
