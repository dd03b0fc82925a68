"""Environments: per-episode state whose methods are the model's tools, with a reward of its own.

An environment is a subclass of :class:`Environment`. Every public method other than ``reset``
and ``reward`` is a tool (typed and docstringed, like any tool). One instance serves one
episode: ``reset(row, seed)`` starts it (and may return text added to the prompt's last user
message), the tools change its state, and ``reward()`` may score the episode at its end.

The seed comes from the run's seed, the step, the prompt's index and the generation, so a
resumed run rebuilds the same environments and the same tool results. An environment with
external state (a database, a repository on disk) must rebuild that state from ``row`` and
``seed`` in ``reset``: nothing else is restored on resume.

Configs name environments beside ``rewards:``; a row picks one by class name in its
``environment`` column (with one environment configured, every row uses it).
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable
from typing import Any

from tunelab.errors import ConfigError
from tunelab.rl.agentic.tools import Tool, tool_from_function

__all__ = ["Environment", "KeyValueStore", "environment_tools", "public_tools"]

_LIFECYCLE = frozenset({"reset", "reward"})


class Environment:
    """The base of environments: override ``reset``, add tool methods, optionally ``reward``."""

    def reset(self, row: dict[str, Any], seed: int) -> str | None:
        """Start an episode.

        Args:
            row: The prompt's dataset row.
            seed: This episode's seed (draw any randomness from it).

        Returns:
            Text added to the prompt's last user message, or None.
        """
        return None

    def reward(self) -> float | None:
        """The environment's score of the finished episode, or None (no reward of its own)."""
        return None


def public_tools(instance: Any, where: str) -> dict[str, Tool]:
    """The public methods of ``instance`` (``reset`` and ``reward`` aside) as tools by name.

    Raises:
        ConfigError: A method's schema cannot be derived (naming ``where``).
    """
    tools = {}
    for name, method in inspect.getmembers(instance, inspect.ismethod):
        if name.startswith("_") or name in _LIFECYCLE:
            continue
        tool = tool_from_function(method, where)
        tools[tool.name] = tool
    return tools


def environment_tools(factory: Callable[[], Environment], name: str) -> dict[str, Tool]:
    """The tools an environment class offers (its schemas, read from a throw-away instance).

    Raises:
        ConfigError: It is not an :class:`Environment`, or a method's schema cannot be
            derived.
    """
    instance = factory()
    if not isinstance(instance, Environment):
        raise ConfigError(f"environment {name}: not a tunelab.rl.agentic.Environment subclass")
    return public_tools(instance, f"environment {name}")


def checked_reset(environment: Environment, row: dict[str, Any], seed: int, name: str) -> str:
    """``reset`` with its result checked: the text added to the prompt ('' for none).

    Raises:
        ConfigError: ``reset`` raised or returned something other than text or None (one line
            naming the class).
    """
    try:
        added = environment.reset(row, seed)
    except Exception as error:
        raise ConfigError(
            f"environment {name}: reset raised {type(error).__name__}: {error}"
        ) from None
    if added is not None and not isinstance(added, str):
        raise ConfigError(
            f"environment {name}: reset returned {type(added).__name__}; return text or None"
        )
    return added or ""


def checked_reward(environment: Environment, name: str) -> float | None:
    """``reward`` with its result checked (a finite number or None).

    Raises:
        ConfigError: ``reward`` raised or returned something else (one line naming the class).
    """
    try:
        value = environment.reward()
    except Exception as error:
        raise ConfigError(
            f"environment {name}: reward raised {type(error).__name__}: {error}"
        ) from None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(
            f"environment {name}: reward returned {value!r}; return a finite number or None"
        )
    return float(value)


class KeyValueStore(Environment):
    """A small multi-step environment: read two keys of a store, write their sum to a third.

    ``reset`` fills the store with ``num_keys`` keys and random values and asks for
    ``total = a + b`` of two of them; the reward is 1.0 when ``total`` holds the sum, 0.5 when
    both keys were read but the sum is wrong or missing, else 0.0.

    Args:
        num_keys: Keys in the store.
        max_value: Values are drawn from ``0..max_value``.
    """

    def __init__(self, num_keys: int = 4, max_value: int = 99) -> None:
        self.num_keys = num_keys
        self.max_value = max_value
        self.store: dict[str, int] = {}
        self.read: set[str] = set()
        self.wanted: tuple[str, str] = ("", "")
        self.expected = 0

    def reset(self, row: dict[str, Any], seed: int) -> str | None:
        """Fill the store from ``seed`` and ask for the sum of two of its keys."""
        rng = random.Random(seed)
        names = rng.sample("abcdefghijklmnopqrstuvwxyz", self.num_keys)
        self.store = {name: rng.randint(0, self.max_value) for name in names}
        self.read = set()
        first, second = rng.sample(names, 2)
        self.wanted = (first, second)
        self.expected = self.store[first] + self.store[second]
        return f"Set key total to the value of key {first} plus the value of key {second}."

    def get(self, key: str) -> str:
        """Read a key of the store.

        Args:
            key: The key to read.
        """
        if key not in self.store:
            raise KeyError(f"no key {key!r}")
        self.read.add(key)
        return str(self.store[key])

    def set(self, key: str, value: int) -> str:
        """Write a key of the store.

        Args:
            key: The key to write.
            value: Its new value.
        """
        self.store[key] = value
        return "ok"

    def reward(self) -> float | None:
        """1.0 when ``total`` is the sum; 0.5 when both keys were read; else 0.0."""
        if self.store.get("total") == self.expected:
            return 1.0
        return 0.5 if set(self.wanted) <= self.read else 0.0
