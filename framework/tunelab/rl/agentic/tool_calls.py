"""Tool calls parsed from a policy's generated text, in the model's own format.

The formats are those the chat templates render (and the data side reads):

- ``hermes``: Qwen 2.5, Qwen3 and the tiny tool template: ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, any number, with an optional ``<think>...</think>`` block
  before them (the message's ``reasoning_content``);
- ``llama3_json``: Llama 3.1 / 3.2: the whole reply is one ``{"name": ..., "parameters":
  {...}}`` object (after an optional ``<|python_tag|>``);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

``tool_format: auto`` picks the format from the chat template's text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tunelab.errors import ConfigError
from tunelab.rl.agentic.tools import ToolCall

__all__ = ["FORMATS", "detect_format", "parse_assistant"]

FORMATS = ("hermes", "llama3_json", "mistral")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_THINK = re.compile(r"^\s*<think>\n?(.*?)\n?</think>\s*", re.DOTALL)


def detect_format(template_text: str) -> str:
    """The tool-call format a chat template renders.

    Raises:
        ConfigError: The template renders none of :data:`FORMATS` (set ``tool_format``).
    """
    if "<tool_call>" in template_text:
        return "hermes"
    if "[TOOL_CALLS]" in template_text:
        return "mistral"
    if "ipython" in template_text or "<|python_tag|>" in template_text:
        return "llama3_json"
    raise ConfigError(
        "agentic.tool_format: auto found no tool-call format in the chat template (none of "
        "<tool_call>, [TOOL_CALLS], ipython); set one of " + ", ".join(FORMATS)
    )


def call_id(turn: int, number: int) -> str:
    """A call's id: 9 alphanumeric characters (Mistral's templates require exactly that)."""
    return f"c{turn:03d}{number:05d}"


def _call(value: Any, turn: int, number: int, arguments_key: str) -> ToolCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(
            "", json.dumps(value) if not isinstance(value, str) else value, call_id(turn, number)
        )
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # arguments given as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return ToolCall(value["name"], arguments, call_id(turn, number))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_assistant(
    text: str, tool_format: str, turn: int
) -> tuple[dict[str, Any], list[ToolCall]]:
    """The assistant message of one generated turn, and the calls it makes.

    Args:
        text: The turn's generated text (special tokens kept, the final stop token removed).
        tool_format: One of :data:`FORMATS`.
        turn: The turn's number in the episode (for the calls' ids).

    Returns:
        ``(message, calls)``: the message as the chat template takes it (``role``,
        ``content``, and ``reasoning_content`` / ``tool_calls`` when present) and the calls in
        order. A call that is not a JSON object with a ``name`` is a call to the tool ``""``
        (it fails as an unknown tool, so the model reads why).
    """
    message: dict[str, Any] = {"role": "assistant"}
    calls: list[ToolCall] = []
    if tool_format == "hermes":
        think = _THINK.match(text)
        if think is not None:
            message["reasoning_content"] = think.group(1)
            text = text[think.end() :]
        bodies = _HERMES.findall(text)
        calls = [_call(_loads(body), turn, n, "arguments") for n, body in enumerate(bodies)]
        first = text.find("<tool_call>")
        content = text if first < 0 else text[:first]
        message["content"] = content.rstrip("\n") if calls else content
    elif tool_format == "llama3_json":
        body = text.removeprefix("<|python_tag|>").strip()
        value = _loads(body) if body.startswith("{") else None
        if isinstance(value, dict) and "name" in value:
            calls = [_call(value, turn, 0, "parameters")]
            message["content"] = ""
        else:
            message["content"] = text
    elif tool_format == "mistral":
        head, marker, tail = text.partition("[TOOL_CALLS]")
        message["content"] = head
        if marker:
            value = _loads(tail.strip())
            values = value if isinstance(value, list) else [value]
            calls = [_call(item, turn, n, "arguments") for n, item in enumerate(values)]
    else:
        raise ConfigError(
            f"agentic.tool_format: {tool_format!r} is not one of {', '.join(FORMATS)}"
        )
    if calls:
        message["tool_calls"] = [call.message() for call in calls]
    return message, calls
