"""What episodes may call: the shared tools and the environments, built from config nodes.

``tools:`` nodes name a typed, docstringed function (the tool itself, no settings) or a class
whose instance's public methods are tools (settings as keys, e.g. ``PythonSandbox``'s
limits); one instance serves every episode. ``environments:`` nodes name
:class:`~tunelab.rl.agentic.Environment` subclasses (settings as keys): each episode gets an
instance of its own.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tunelab.config._instantiate import COMPONENT_KEY, import_component
from tunelab.errors import ConfigError
from tunelab.rl.agentic.environments import (
    Environment,
    checked_reset,
    environment_tools,
    public_tools,
)
from tunelab.rl.agentic.tools import Tool, tool_from_function

__all__ = ["EpisodeTools", "Toolbox"]

ENVIRONMENT_COLUMN = "environment"
"""The row column naming the episode's environment (a class name)."""


class EpisodeTools:
    """One episode's tools (shared and its environment's) and its environment instance.

    Attributes:
        tools: By name.
        environment: The instance, or None.
        environment_name: Its class name ('' for none).
        added_prompt: What ``reset`` added to the prompt ('' for nothing).
    """

    def __init__(
        self,
        tools: dict[str, Tool],
        environment: Environment | None,
        environment_name: str,
        added_prompt: str,
    ) -> None:
        self.tools = tools
        self.environment = environment
        self.environment_name = environment_name
        self.added_prompt = added_prompt

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, as the chat template's ``tools``."""
        return [tool.schema for tool in self.tools.values()]


class Toolbox:
    """The tools every episode may call and the environments rows may name.

    Args:
        tools: Typed, docstringed functions, or objects whose public methods are tools.
        environments: Environment name -> a factory of fresh instances (the class, or a
            ``functools.partial`` with its settings).

    Raises:
        ConfigError: A tool's schema cannot be derived, two tools share a name, or an
            environment factory does not make an ``Environment``.
    """

    def __init__(
        self,
        tools: Sequence[Any] = (),
        environments: Mapping[str, Callable[[], Environment]] | None = None,
    ) -> None:
        self.shared: dict[str, Tool] = {}
        for item in tools:
            if inspect.isfunction(item) or inspect.ismethod(item):
                found = {tool.name: tool for tool in [tool_from_function(item, "tools")]}
            else:
                found = public_tools(item, f"tools: {type(item).__name__}")
            for name, tool in found.items():
                if name in self.shared:
                    raise ConfigError(f"tools: two tools are named {name!r}")
                self.shared[name] = tool
        self.environments = dict(environments or {})
        for name, factory in self.environments.items():
            clash = set(environment_tools(factory, name)) & set(self.shared)
            if clash:
                raise ConfigError(
                    f"environment {name}: its tool {sorted(clash)[0]!r} has the name of a shared tool"
                )

    @classmethod
    def from_nodes(cls, tools: Sequence[Any] | None, environments: Sequence[Any] | None) -> Toolbox:
        """The toolbox of a recipe's ``agentic.tools`` and ``agentic.environments`` nodes."""
        shared = []
        for index, node in enumerate(tools or ()):
            where = f"agentic.tools[{index}]"
            target, settings = _resolve(node, where)
            if inspect.isclass(target):
                shared.append(target(**settings))
            elif settings:
                raise ConfigError(
                    f"{where}: a function tool takes no settings ({', '.join(settings)})"
                )
            else:
                shared.append(target)
        factories = {}
        for index, node in enumerate(environments or ()):
            where = f"agentic.environments[{index}]"
            target, settings = _resolve(node, where)
            if not (inspect.isclass(target) and issubclass(target, Environment)):
                raise ConfigError(f"{where}: {target!r} is not an Environment subclass")
            factories[target.__name__] = functools.partial(target, **settings)
        return cls(shared, factories)

    def start(self, row: Mapping[str, Any], seed: int) -> EpisodeTools:
        """A fresh episode's tools: its environment built and reset from ``row`` and ``seed``.

        Raises:
            ConfigError: The row names an unknown environment, or the environment is broken
                (one line naming its class).
        """
        name = row.get(ENVIRONMENT_COLUMN) if isinstance(row, Mapping) else None
        if name is None and len(self.environments) == 1:
            name = next(iter(self.environments))
        if name is None:
            return EpisodeTools(dict(self.shared), None, "", "")
        if name not in self.environments:
            known = ", ".join(self.environments) or "none configured"
            raise ConfigError(f"a row names environment {name!r}; known: {known}")
        try:
            environment = self.environments[name]()
        except Exception as error:
            raise ConfigError(f"environment {name}: {type(error).__name__}: {error}") from None
        added = checked_reset(environment, dict(row), seed, name)
        tools = dict(self.shared) | public_tools(environment, f"environment {name}")
        return EpisodeTools(tools, environment, name, added)


def _resolve(node: Any, where: str) -> tuple[Any, dict[str, Any]]:
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, Mapping) or COMPONENT_KEY not in node:
        raise ConfigError(f"{where}: give a node with {COMPONENT_KEY}")
    settings = {key: value for key, value in node.items() if key != COMPONENT_KEY}
    return import_component(node[COMPONENT_KEY], where), settings
