"""Tools a policy may call during an episode: typed, docstringed Python callables.

A tool is a plain function (or an environment's method) with type hints and a Google-style
docstring. Its JSON schema is derived from the signature by ``transformers``'
``get_json_schema`` (the schema ``apply_chat_template(tools=[f])`` renders), so the model sees
the tool exactly as it would when served with ``transformers``.

A call never raises into the run: :func:`call_tool` turns an unknown tool, arguments the schema
refuses, an exception in the tool and a non-text result into a :class:`ToolResult` whose
``error`` names the kind (``unknown_tool``, ``bad_arguments``, ``exception``, ``timeout``,
``sandbox``, ``crash``), and whose ``content`` is the message the model reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tunelab.data._tool_schema import schema_problem
from tunelab.errors import ConfigError

__all__ = [
    "ERROR_KINDS",
    "Tool",
    "ToolCall",
    "ToolFailure",
    "ToolResult",
    "call_tool",
    "tool_from_function",
]

ERROR_KINDS = ("unknown_tool", "bad_arguments", "exception", "timeout", "sandbox", "crash")
"""The kinds of tool error an episode counts (``agentic/tool_errors/<kind>``); ``crash``: the
worker process running the call died (``tool_processes``)."""


class ToolFailure(Exception):
    """Raised by a tool to report a failure of a kind (``sandbox``, ``timeout``) as its result.

    Args:
        kind: One of :data:`ERROR_KINDS`.
        message: What the model reads.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Tool:
    """A callable the model may call, with the JSON schema the chat template renders.

    Attributes:
        name: The name the model calls it by.
        schema: ``{"type": "function", "function": {"name", "description", "parameters"}}``.
        function: The callable; it takes the call's arguments as keywords.
    """

    name: str
    schema: dict[str, Any]
    function: Callable[..., Any]


@dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from the policy's generated text.

    Attributes:
        name: The tool named.
        arguments: The parsed arguments (a JSON object), or the raw text when they were no
            JSON object (the call then fails with ``bad_arguments``).
        id: The call's id (rendered by templates that show ids, such as Mistral's).
    """

    name: str
    arguments: dict[str, Any] | str
    id: str

    def message(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry (OpenAI's layout)."""
        arguments = self.arguments if isinstance(self.arguments, dict) else {}
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


@dataclass(frozen=True)
class ToolResult:
    """What a call returned: the text the model reads, and the error kind when it failed.

    Attributes:
        content: The tool message's content.
        error: None, or one of :data:`ERROR_KINDS`.
        seconds: Wall time of the call.
    """

    content: str
    error: str | None = None
    seconds: float = 0.0


def tool_from_function(function: Callable[..., Any], where: str) -> Tool:
    """A :class:`Tool` from a typed, docstringed function or bound method.

    Args:
        function: The function; its name is the tool's name.
        where: Who offers it (a config key or an environment class), for errors.

    Returns:
        The tool, with the schema ``transformers.utils.get_json_schema`` derives.

    Raises:
        ConfigError: The schema cannot be derived (no docstring, an argument without a type
            hint or without a line in ``Args:``).
    """
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(function)
    except Exception as error:  # transformers raises several types for one cause
        name = getattr(function, "__qualname__", repr(function))
        raise ConfigError(f"{where}: tool {name}: {error}") from None
    schema["function"].pop("return", None)  # templates render the arguments, not the return
    return Tool(schema["function"]["name"], schema, function)


def call_tool(tools: Mapping[str, Tool], call: ToolCall) -> ToolResult:
    """Run one call; every failure becomes a result the model reads (never an exception).

    Args:
        tools: The episode's tools by name.
        call: The parsed call.

    Returns:
        The result; ``error`` set when the tool is unknown, the arguments do not fit its
        schema, or it raised (its message is the content).
    """
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return ToolResult(f"Error: no tool {call.name!r} (tools: {known})", "unknown_tool")
    if not isinstance(call.arguments, dict):
        return ToolResult(
            f"Error: the arguments of {call.name} are not a JSON object: "
            f"{str(call.arguments)[:200]}",
            "bad_arguments",
        )
    problem = schema_problem(call.arguments, tool.schema["function"].get("parameters"))
    if problem is not None:
        return ToolResult(f"Error: {call.name}: {problem}", "bad_arguments")
    try:
        value = tool.function(**call.arguments)
    except ToolFailure as failure:
        return ToolResult(f"Error: {failure}", failure.kind)
    except TypeError as error:  # a keyword the function does not take
        return ToolResult(f"Error: {call.name}: {error}", "bad_arguments")
    except Exception as error:  # a tool is user code: its failure is the model's to read
        return ToolResult(f"Error: {call.name} raised {type(error).__name__}: {error}", "exception")
    return ToolResult(value if isinstance(value, str) else json.dumps(value, default=str))
