"""Tool calls are checked against the row's declared tools and their JSON schemas.

Issue 38, finding 6: a call to a tool the row does not declare, or with arguments of the wrong
type, was trained as it was. Now it is a malformed row (one error naming ``file:line``, or
skipped with ``skip_malformed``) in chat, preference and prompt datasets alike.
"""

import json

import pytest

from tunelab._paths import assets_dir
from tunelab.data import chat_dataset, load_tokenizer, preference_dataset, prompt_dataset
from tunelab.data._tool_schema import check_tool_calls, schema_problem
from tunelab.data.conversations import read_conversation
from tunelab.data.rows import BadRow
from tunelab.errors import DataError

TINY = assets_dir() / "tiny"
PARAMETERS = {
    "type": "object",
    "properties": {
        "location": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
        "hours": {"type": "array", "items": {"type": "integer"}},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["location"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather.", "parameters": PARAMETERS},
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY, chat_template=str(TINY / "tools_chat_template.jinja"))


def calling(name="get_weather", arguments='{"location": "Paris"}'):
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22"},
        {"role": "assistant", "content": "22 degrees."},
    ]


def write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


BAD_CALLS = [
    (
        calling(name="get_time"),
        r"message 1: tool call 0 \(get_time\): no tool 'get_time' among the row's tools "
        r"\('get_weather'\)",
    ),
    (
        calling(arguments={"location": 3}),
        r"message 1: tool call 0 \(get_weather\): arguments\.location: expected string, got "
        r"integer 3 \(the tool's parameters schema\)",
    ),
    (
        calling(arguments='{"location": "Paris", "days": "two"}'),
        r"arguments\.days: expected integer, got string \"two\"",
    ),
    (calling(arguments={"unit": "celsius"}), r"arguments: missing required 'location'"),
    (
        calling(arguments={"location": "Paris", "unit": "kelvin"}),
        r"arguments\.unit: \"kelvin\" is not one of \"celsius\", \"fahrenheit\"",
    ),
    (
        calling(arguments={"location": "Paris", "hours": [1, "2"]}),
        r"arguments\.hours\[1\]: expected integer, got string",
    ),
]


@pytest.mark.parametrize(("messages", "problem"), BAD_CALLS)
def test_a_call_that_breaks_the_declared_tools_is_a_malformed_row(
    tmp_path, tokenizer, messages, problem
):
    good = {"tools": [WEATHER], "messages": calling()}
    path = write(tmp_path / "tools.jsonl", [good, {"tools": [WEATHER], "messages": messages}])
    cache = str(tmp_path / "cache")
    with pytest.raises(DataError, match=r"tools\.jsonl:2: row 1 \(0-based\), column 'messages': "):
        chat_dataset(tokenizer, source=path, cache_dir=cache)
    with pytest.raises(DataError, match=problem):
        chat_dataset(tokenizer, source=path, cache_dir=cache)
    dataset = chat_dataset(tokenizer, source=path, cache_dir=cache, skip_malformed=True)
    assert len(dataset) == 1 and dataset.num_skipped == 1


def test_calls_that_fit_and_rows_without_tools_train(tmp_path, tokenizer):
    fits = calling(arguments={"location": "Paris", "days": 2.0, "hours": [1], "note": None})
    bare = {"name": "get_weather", "parameters": PARAMETERS}  # a bare function object
    rows = [
        {"tools": [WEATHER], "messages": calling()},
        {"tools": [WEATHER], "messages": fits},
        # No tools declared: nothing to check the call against (tools in the system prompt).
        {"messages": calling(name="anything", arguments={"x": 1})},
        # A schema the checker does not understand (Python's type names) checks nothing.
        {
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"location": {"type": "str"}}}}}],
            "messages": calling(arguments={"location": 3}),
        },
    ]  # fmt: skip
    path = write(tmp_path / "tools.jsonl", rows)
    dataset = chat_dataset(tokenizer, source=path, cache_dir=str(tmp_path / "cache"))
    assert len(dataset) == 4 and dataset.num_skipped == 0
    # A bare function object declares a tool too (the tiny template reads OpenAI's layout).
    check_tool_calls(read_conversation(calling(), "messages"), [bare], "messages")
    with pytest.raises(BadRow, match="no tool 'get_time'"):
        check_tool_calls(read_conversation(calling("get_time"), "messages"), [bare], "messages")


def test_the_embedded_tool_rows_fit_their_tools(tokenizer, tmp_path):
    dataset = chat_dataset(
        tokenizer, source=str(TINY / "tool_calls.jsonl"), cache_dir=str(tmp_path / "cache")
    )
    assert len(dataset) == 300 and dataset.num_skipped == 0


def test_sharegpt_function_calls_are_checked(tmp_path, tokenizer):
    row = {
        "tools": json.dumps([WEATHER]),
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {}}'},
            {"from": "observation", "value": "22"},
            {"from": "gpt", "value": "22 degrees."},
        ],
    }
    path = write(tmp_path / "tools.jsonl", [row])
    with pytest.raises(
        DataError,
        match=r"tools\.jsonl:1: row 0 \(0-based\), column 'conversations': message 1: tool "
        r"call 0 \(get_weather\): arguments: missing required 'location'",
    ):
        chat_dataset(tokenizer, source=path, cache_dir=str(tmp_path / "cache"))


def test_prompt_and_preference_rows_are_checked_too(tmp_path, tokenizer):
    history = calling()[:3]  # the history a GRPO prompt may carry
    wrong = calling(name="get_time")[:3]
    rows = [{"tools": [WEATHER], "prompt": history}, {"tools": [WEATHER], "prompt": wrong}]
    path = write(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(
        DataError,
        match=r"prompts\.jsonl:2: row 1 \(0-based\), column 'prompt': message 1: tool call 0 "
        r"\(get_time\): no tool 'get_time'",
    ):
        prompt_dataset(tokenizer, source=path)
    dataset = prompt_dataset(tokenizer, source=path, skip_malformed=True)
    assert len(dataset) == 1 and dataset.num_skipped == 1
    answer = calling(arguments={"location": 3})[1:]
    pair = {"tools": [WEATHER], "prompt": "Weather in Paris?", "chosen": answer,
            "rejected": "I cannot tell."}  # fmt: skip
    path = write(tmp_path / "pairs.jsonl", [pair])
    with pytest.raises(
        DataError,
        match=r"pairs\.jsonl:1: row 0 \(0-based\), column 'chosen': message 0: tool call 0 "
        r"\(get_weather\): arguments\.location: expected string",
    ):
        preference_dataset(tokenizer, source=path, cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize(
    ("value", "schema", "problem"),
    [
        ({"a": True}, {"properties": {"a": {"type": "integer"}}}, "arguments.a: expected integer, got boolean true"),
        ({"a": 1.5}, {"properties": {"a": {"type": "integer"}}}, "arguments.a: expected integer, got number 1.5"),
        ({"a": 1}, {"properties": {"a": {"type": ["string", "null"]}}}, "arguments.a: expected string or null, got integer 1"),
        ({"b": 1}, {"properties": {"a": {}}, "additionalProperties": False}, "arguments.b: not a parameter of the tool (its parameters: a)"),
        ({"b": "x"}, {"additionalProperties": {"type": "number"}}, 'arguments.b: expected number, got string "x"'),
        ({"a": 2}, {"properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}, "arguments.a: 2 fits none of its anyOf schemas"),
        ({"a": {"b": [{"c": "x"}]}}, {"properties": {"a": {"properties": {"b": {"items": {"properties": {"c": {"const": "y"}}}}}}}}, 'arguments.a.b[0].c: "x" is not "y"'),
        ({"a": 1}, {"properties": {"a": {"type": "number", "minimum": 5}}}, None),  # not checked
        ({"a": 1}, {"$ref": "#/definitions/x"}, None),
        ({"a": 1}, None, None),
    ],
)  # fmt: skip
def test_the_schema_subset(value, schema, problem):
    assert schema_problem(value, schema) == problem
