"""Conversation rows for chat templates: tool calls, tool results, reasoning, tools, documents.

A row's conversation is read into the messages ``transformers``' ``apply_chat_template`` takes
(OpenAI's layout), checked, and handed to the template as they are, with the row's ``tools``
(JSON schemas) and ``documents``:

- ``{"role": "assistant", "content": ..., "tool_calls": [{"id", "type": "function",
  "function": {"name", "arguments"}}]}``: ``arguments`` may be an object or a JSON string (the
  OpenAI API's form); a string is parsed into the object, as vLLM does before it renders a
  ``transformers`` template, so templates that write ``arguments | tojson`` (Llama 3.x, Qwen)
  show the call the way the model is served. ``content`` may be missing or null on such a turn.
- ``{"role": "tool", "content": ..., "tool_call_id": ..., "name": ...}``: the result of a call
  made by the assistant turn before it (``tool_call_id`` and ``name``, when given, must match
  one of that turn's calls).
- ``reasoning_content`` (or ``thinking``, ``reasoning``) on assistant turns, passed as
  ``transformers`` passes it.
- ShareGPT: ``function_call`` turns (a ``{"name", "arguments"}`` object as JSON text, or a list
  of them) become assistant tool calls, ``observation`` (or ``tool``) turns tool results.

When the row declares ``tools``, each call must name one of them, and its arguments must fit
that tool's ``parameters`` JSON schema (``tunelab.data._tool_schema``: types, properties,
required, enum, items, ...); a row without ``tools`` has nothing to check its calls against.

A row that breaks these rules raises ``BadRow`` (a malformed row: one error naming
``file:line``, or skipped with ``skip_malformed``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tunelab.data._tool_schema import check_tool_calls
from tunelab.data.chat_template import REASONING_KEYS, ChatTemplate
from tunelab.data.rows import BadRow, Render, conversation_style, read_text

# Roles a chat-template conversation may use.
CHAT_ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names to roles; function_call turns are assistant tool calls.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}


def _json_value(value: Any, column: str, what: str) -> Any:
    """``value``, parsed when it is JSON text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise BadRow(column, f"{what}: not valid JSON ({error})") from None


def _tool_call(call: Any, column: str, where: str) -> dict[str, Any]:
    """One OpenAI tool call, checked, with its ``arguments`` as an object."""
    if not isinstance(call, dict):
        raise BadRow(column, f"{where}: expected an object, got {type(call).__name__}")
    function = call.get("function", call)  # ShareGPT's function_call is the function itself
    if not isinstance(function, dict):
        raise BadRow(column, f"{where}: 'function' must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise BadRow(column, f"{where}: missing function 'name'")
    if "arguments" not in function:
        raise BadRow(column, f"{where} ({name}): missing 'arguments'")
    arguments = _json_value(function["arguments"], column, f"{where} ({name}): arguments")
    if not isinstance(arguments, dict):
        raise BadRow(
            column,
            f"{where} ({name}): arguments must be a JSON object, got {type(arguments).__name__}",
        )
    result: dict[str, Any] = {}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise BadRow(column, f"{where} ({name}): 'id' must be a string")
        result["id"] = call["id"]
    result["type"] = call.get("type") or "function"
    result["function"] = {"name": name, "arguments": arguments}
    return result


def _tool_calls(value: Any, column: str, index: int) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRow(column, f"message {index}: tool_calls must be a non-empty list")
    return [
        _tool_call(call, column, f"message {index}: tool call {j}") for j, call in enumerate(value)
    ]


def _openai_message(message: dict[str, Any], column: str, index: int) -> dict[str, Any]:
    role = message.get("role")
    if role is None:
        raise BadRow(column, f"message {index}: missing 'role'")
    if role not in CHAT_ROLES:
        raise BadRow(column, f"message {index}: unknown role {role!r} ({', '.join(CHAT_ROLES)})")
    out: dict[str, Any] = {"role": role}
    content = message.get("content")
    if message.get("tool_calls") == []:  # exports often write an empty list for "no calls"
        message = {key: value for key, value in message.items() if key != "tool_calls"}
    has_calls = role == "assistant" and message.get("tool_calls") is not None
    if content is None and not has_calls:
        raise BadRow(column, f"message {index}: missing 'content'")
    if content is not None:
        if not isinstance(content, str):
            raise BadRow(
                column, f"message {index}: content is {type(content).__name__}, not a string"
            )
        out["content"] = content
    if has_calls:
        out["tool_calls"] = _tool_calls(message["tool_calls"], column, index)
    elif message.get("tool_calls") is not None:
        raise BadRow(column, f"message {index}: only assistant messages make tool calls")
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            if role != "tool" or not isinstance(message[key], str):
                raise BadRow(column, f"message {index}: {key!r} must be a string on a tool message")
            out[key] = message[key]
    for key in REASONING_KEYS:
        if message.get(key) is not None:
            if role != "assistant" or not isinstance(message[key], str):
                raise BadRow(
                    column, f"message {index}: {key!r} must be a string on an assistant message"
                )
            out[key] = message[key]
    return out


def _sharegpt_message(message: dict[str, Any], column: str, index: int) -> dict[str, Any]:
    speaker, value = message.get("from"), message.get("value")
    if speaker is None or value is None:
        raise BadRow(column, f"message {index}: missing {'from' if speaker is None else 'value'!r}")
    role = SHAREGPT_ROLES.get(speaker)
    if role is None:
        raise BadRow(
            column, f"message {index}: unknown role {speaker!r} ({', '.join(SHAREGPT_ROLES)})"
        )
    if not isinstance(value, str):
        raise BadRow(column, f"message {index}: value is {type(value).__name__}, not a string")
    if speaker != "function_call":
        return {"role": role, "content": value}
    calls = _json_value(value, column, f"message {index}: function_call")
    calls = calls if isinstance(calls, list) else [calls]
    return {"role": "assistant", "content": "", "tool_calls": _tool_calls(calls, column, index)}


def _check_tool_results(messages: list[dict[str, Any]], column: str, start: int = 0) -> None:
    """Every tool message answers a call of the assistant turn before it (no orphans).

    Only messages from ``start`` on are checked (the earlier ones make calls); errors number
    them from ``start``, as their column holds them.
    """
    calls: list[dict[str, Any]] | None = None
    for position, message in enumerate(messages):
        index = position - start
        role = message["role"]
        if role == "assistant":
            calls = message.get("tool_calls")
        elif role == "tool":
            if index < 0:
                continue
            if not calls:
                raise BadRow(
                    column,
                    f"message {index}: tool message with no matching call (no assistant "
                    "tool call before it)",
                )
            for key, field in (("tool_call_id", "id"), ("name", "name")):
                wanted = message.get(key)
                known = [call.get(field) or call["function"].get(field) for call in calls]
                if wanted is not None and wanted not in known:
                    raise BadRow(
                        column,
                        f"message {index}: tool message with no matching call ({key} "
                        f"{wanted!r}; the calls before it: {', '.join(map(repr, known))})",
                    )
        else:
            calls = None


def read_conversation(value: Any, column: str, style: str = "auto") -> list[dict[str, Any]]:
    """Read and check a conversation for a chat template.

    Args:
        value: The cell: a non-empty list of messages.
        column: Its column name, for errors.
        style: ``openai``, ``sharegpt`` or ``auto`` (ShareGPT when the first message has
            ``from`` / ``value`` and no ``role`` / ``content``).

    Returns:
        Messages in OpenAI's layout (roles ``system``, ``user``, ``assistant``, ``tool``).

    Raises:
        BadRow: If the conversation is missing or empty, a message is malformed, a tool call's
            arguments are not a JSON object, a tool message answers no call, or there is no
            assistant turn or an empty one (no content and no tool call).
    """
    messages = _read_messages(value, column, style)
    _check_tool_results(messages, column)
    replies = [m for m in messages if m["role"] == "assistant"]
    if not replies:
        raise BadRow(column, "no assistant message")
    if any(not m.get("content", "").strip() and not m.get("tool_calls") for m in replies):
        raise BadRow(column, "empty assistant message")
    return messages


def read_part(value: Any, column: str, default_role: str) -> list[dict[str, Any]]:
    """One part of a conversation (a preference pair's prompt or answer, a GRPO prompt).

    A string is one ``default_role`` message; a list is messages in any form
    ``read_conversation`` takes (tool calls, tool results, reasoning; OpenAI or ShareGPT),
    each checked. The joined conversation is checked by ``check_parts``.

    Raises:
        BadRow: If the value is missing or empty, or a message is malformed.
    """
    if value is None or isinstance(value, str):
        return [{"role": default_role, "content": read_text({column: value}, column)}]
    return _read_messages(value, column, "auto")


def _read_messages(value: Any, column: str, style: str) -> list[dict[str, Any]]:
    """Each message of a list in ``style`` (or the one it is, for ``"auto"``), checked."""
    style = conversation_style(value, column, style)
    read = _sharegpt_message if style == "sharegpt" else _openai_message
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadRow(column, f"message {index}: expected a dict, got {type(message).__name__}")
        messages.append(read(message, column, index))
    return messages


def check_parts(
    messages: list[dict[str, Any]],
    answer_start: int,
    prompt_column: str,
    answer_column: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> None:
    """Check a conversation joined from parts: tool results answer calls; the answer replies.

    Args:
        messages: The whole conversation: the prompt, then the answer.
        answer_start: Index of the answer's first message (``len(messages)``: no answer, as
            for a GRPO prompt).
        prompt_column: The prompt's column, for errors in the prompt.
        answer_column: The answer's column, for errors in the answer.
        tools: The row's tools: each call must name one, with arguments its schema takes
            (``check_tool_calls``).

    Raises:
        BadRow: If a tool message answers no call, a call names no declared tool or breaks
            its schema, or the answer has no assistant turn or an empty one (no content and
            no tool call).
    """
    _check_tool_results(messages[:answer_start], prompt_column)
    check_tool_calls(messages[:answer_start], tools, prompt_column)
    if answer_start == len(messages):
        return
    column = answer_column or prompt_column
    _check_tool_results(messages, column, start=answer_start)
    check_tool_calls(messages[answer_start:], tools, column)
    replies = [m for m in messages[answer_start:] if m["role"] == "assistant"]
    if not replies:
        raise BadRow(column, "no assistant message")
    if any(not m.get("content", "").strip() and not m.get("tool_calls") for m in replies):
        raise BadRow(column, "empty assistant message")


def read_tools(row: dict[str, Any], column: str) -> list[dict[str, Any]] | None:
    """A row's ``tools``: a list of JSON schemas (objects), or JSON text of one; None if absent.

    Raises:
        BadRow: If it is not a list of objects.
    """
    tools = _json_value(row.get(column), column, "tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise BadRow(column, "tools must be a list of JSON schemas (objects)")
    return tools or None


def read_documents(row: dict[str, Any], column: str) -> list[dict[str, Any]] | None:
    """A row's ``documents``: a list of objects (``title``, ``text``, ...); None if absent.

    Raises:
        BadRow: If it is not a list of objects.
    """
    documents = row.get(column)
    if documents is None:
        return None
    if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
        raise BadRow(column, "documents must be a list of objects (title, text, ...)")
    return documents or None


def uses_chat_features(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation has tool calls, tool results or reasoning (chat templates only)."""
    return any(
        m["role"] == "tool" or "tool_calls" in m or any(key in m for key in REASONING_KEYS)
        for m in messages
    )


@dataclass
class ChatRows:
    """Row function of ``chat_dataset``: one conversation, with the row's tools and documents.

    With a named format (a base model's) a conversation is ``(role, content)`` turns only:
    tool calls, tool results and reasoning need the model's own chat template.
    """

    render: Render
    column: str
    style: str
    tools_column: str = "tools"
    documents_column: str = "documents"

    @property
    def max_chars(self) -> int | None:
        """Characters of a text that can reach a sample (``text_bound``)."""
        return self.render.max_chars

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Samples of one row; raises ``BadRow``."""
        messages = read_conversation(row.get(self.column), self.column, self.style)
        tools = read_tools(row, self.tools_column)
        check_tool_calls(messages, tools, self.column)
        documents = read_documents(row, self.documents_column)
        if isinstance(self.render.template, ChatTemplate):
            return self.render.conversation(messages, self.column, tools, documents)
        if uses_chat_features(messages) or tools or documents:
            raise BadRow(
                self.column,
                "tool calls, tool results, reasoning, tools and documents need the model's own "
                "chat template (template: auto), not a named format",
            )
        pairs = [(m["role"], m["content"]) for m in messages]
        return self.render.samples(pairs, self.column)
