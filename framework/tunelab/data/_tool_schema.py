"""Tool calls against the row's declared tools and their JSON schemas (the subset tools use).

A row declares its tools as JSON schemas (OpenAI's ``{"type": "function", "function":
{"name", "parameters"}}``); a call to a tool it does not declare, or whose arguments do not fit
the tool's ``parameters``, teaches the model calls its tools refuse. ``check_tool_calls``
refuses both (``schema_problem`` compares the arguments). ``jsonschema`` is not a dependency of tunelab (nor of the libraries it installs), and
tool declarations use a small part of JSON Schema, so this checks that part itself, with
messages that name the argument:

- ``type`` (a name or a list of names): ``string``, ``integer`` (a whole number; not a
  boolean), ``number`` (not a boolean), ``boolean``, ``object``, ``array``, ``null``;
- ``properties``, ``required`` and ``additionalProperties`` (``false`` or a schema) of an
  object, ``items`` of an array (a schema), ``enum`` and ``const``;
- ``anyOf`` / ``oneOf`` (what pydantic writes for ``Optional``): one branch must fit.

Anything else (``$ref``, ``pattern``, ``minimum``, ``format``, a type name outside the list
above such as Python's ``str``) is not checked: a schema the checker does not understand never
makes a row malformed, only a call that breaks what it does understand.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tunelab.data.rows import BadRow

# JSON type name -> is the (parsed JSON) value of that type.
_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and v.is_integer())
    ),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def json_type(value: Any) -> str:
    """The JSON type name of a parsed value (``integer`` for a whole number)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    for name in ("number", "string", "object", "array", "null"):
        if _TYPES[name](value):
            return name
    return type(value).__name__


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def schema_problem(value: Any, schema: Any, path: str = "arguments") -> str | None:
    """The first way ``value`` breaks ``schema`` (the subset above), or None.

    Args:
        value: The parsed JSON value (a call's arguments, or a part of them).
        schema: Its JSON schema; anything but a mapping checks nothing.
        path: Where ``value`` is, for the message (``arguments.location``).

    Returns:
        ``"arguments.location: expected string, got integer 3"``, or None when it fits.
    """
    if not isinstance(schema, Mapping):
        return None
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            if all(schema_problem(value, branch, path) is not None for branch in branches):
                return f"{path}: {_shown(value)} fits none of its {key} schemas"
    problem = _type_problem(value, schema.get("type"), path)
    if problem is not None:
        return problem
    if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
        allowed = ", ".join(_shown(item) for item in schema["enum"])
        return f"{path}: {_shown(value)} is not one of {allowed}"
    if "const" in schema and value != schema["const"]:
        return f"{path}: {_shown(value)} is not {_shown(schema['const'])}"
    if isinstance(value, dict):
        return _object_problem(value, schema, path)
    if isinstance(value, list):
        for index, item in enumerate(value):
            problem = schema_problem(item, schema.get("items"), f"{path}[{index}]")
            if problem is not None:
                return problem
    return None


def _type_problem(value: Any, wanted: Any, path: str) -> str | None:
    names = wanted if isinstance(wanted, list) else [wanted]
    known = [name for name in names if isinstance(name, str) and name in _TYPES]
    if not known or len(known) < len(names):  # no type, or one this checker does not know
        return None
    if any(_TYPES[name](value) for name in known):
        return None
    return f"{path}: expected {' or '.join(known)}, got {json_type(value)} {_shown(value)}"


def _object_problem(value: dict, schema: Mapping, path: str) -> str | None:
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = schema.get("required")
    for name in required if isinstance(required, list) else []:
        if isinstance(name, str) and name not in value:
            return f"{path}: missing required {name!r}"
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        where = f"{path}.{name}"
        if name in properties:
            problem = schema_problem(item, properties[name], where)
        elif extra is False:
            known = ", ".join(properties) or "none"
            problem = f"{where}: not a parameter of the tool (its parameters: {known})"
        else:
            problem = schema_problem(item, extra, where)
        if problem is not None:
            return problem
    return None


def _declared(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Tool name -> its ``parameters`` schema (None when not given).

    Tools in OpenAI's layout (``{"type": "function", "function": {...}}``) and bare function
    objects (``{"name", "parameters"}``) alike.
    """
    declared: dict[str, Any] = {}
    for tool in tools:
        function = tool.get("function", tool)
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            declared[function["name"]] = function.get("parameters")
    return declared


def check_tool_calls(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, column: str
) -> None:
    """Every tool call names one of the row's declared tools, with arguments its schema takes.

    A row that declares no tools has nothing to check its calls against (datasets that
    describe their tools in the system message): its calls are left as they are.

    Args:
        messages: Messages as ``read_conversation`` / ``read_part`` return them (each call's
            ``arguments`` an object).
        tools: The row's tools (``read_tools``), or None.
        column: The messages' column, for errors (they are numbered from 0 in it).

    Raises:
        BadRow: ``message 2: tool call 0 (get_weather): no tool 'get_weather' among the row's
            tools (...)``, or ``...: arguments.location: expected string, got integer 3``
            (``tunelab.data._tool_schema`` says which parts of JSON Schema are checked).
    """
    if not tools:
        return
    declared = _declared(tools)
    for index, message in enumerate(messages):
        for number, call in enumerate(message.get("tool_calls") or ()):
            name = call["function"]["name"]
            where = f"message {index}: tool call {number} ({name})"
            if name not in declared:
                known = ", ".join(map(repr, declared)) or "none with a name"
                raise BadRow(column, f"{where}: no tool {name!r} among the row's tools ({known})")
            problem = schema_problem(call["function"]["arguments"], declared[name])
            if problem is not None:
                raise BadRow(column, f"{where}: {problem} (the tool's parameters schema)")
