"""Tools, the calculator, the sandbox's limits, tool-call parsing and environments."""

import os
import time

import pytest

from tunelab.errors import ConfigError
from tunelab.rl.agentic import (
    Environment,
    KeyValueStore,
    PythonSandbox,
    Toolbox,
    ToolCall,
    ToolFailure,
    calculator,
    call_tool,
    parse_assistant,
    tool_from_function,
)
from tunelab.rl.agentic.tool_processes import MAX_RUNNING_AFTER_TIMEOUT
from tunelab.rl.agentic.tool_processes import timed_thread_call as _timed_call


def test_calculator_is_arithmetic_only():
    assert calculator("(3 + 4) * 2") == "14"
    assert calculator("7 / 2") == "3.5"
    assert calculator("-2 ** 3 % 5") == str(-(2**3) % 5)
    for bad in ("__import__('os')", "a + 1", "9 ** 9 ** 9", "'x' * 3", "1 +"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_schema_is_transformers_get_json_schema():
    from transformers.utils import get_json_schema

    tool = tool_from_function(calculator, "tools")
    expected = get_json_schema(calculator)
    expected["function"].pop("return", None)
    assert tool.name == "calculator" and tool.schema == expected

    def untyped(x):
        """No types."""

    with pytest.raises(ConfigError, match="tools: tool .*untyped"):
        tool_from_function(untyped, "tools")


def test_every_failure_is_a_result_with_its_kind():
    tools = Toolbox([calculator]).shared
    assert call_tool(tools, ToolCall("calculator", {"expression": "2+2"}, "c")).content == "4"
    cases = {
        "unknown_tool": ToolCall("search", {"q": "x"}, "c"),
        "bad_arguments": ToolCall("calculator", {"expression": 3}, "c"),
        "exception": ToolCall("calculator", {"expression": "1/0"}, "c"),
    }
    for kind, call in cases.items():
        outcome = call_tool(tools, call)
        assert outcome.error == kind and outcome.content.startswith("Error:"), outcome
    assert call_tool(tools, ToolCall("calculator", "not json", "c")).error == "bad_arguments"


def sleeper(name: str):
    """A tool called ``name`` that sleeps (each test its own name: hung calls are per name)."""

    def sleep(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "woke"

    sleep.__name__ = sleep.__qualname__ = name
    return sleep


def test_a_hung_tool_times_out():
    tools = Toolbox([sleeper("wait")]).shared
    start = time.perf_counter()
    outcome = _timed_call(tools, ToolCall("wait", {"seconds": 30}, "c"), 0.3)
    assert outcome.error == "timeout" and time.perf_counter() - start < 5


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(cpu_seconds=1, wall_seconds=20, memory_mb=256, max_output_bytes=4096)


def run(sandbox, code):
    start = time.perf_counter()
    try:
        return sandbox.python(code), None, time.perf_counter() - start
    except ToolFailure as failure:
        return str(failure), failure.kind, time.perf_counter() - start


def test_sandbox_runs_code_in_a_fresh_folder(sandbox):
    text, kind, _ = run(sandbox, "import os\nopen('f', 'w').write('hi')\nprint(os.listdir('.'))")
    assert kind is None and "'f'" in text


def test_sandbox_hides_the_runs_environment(sandbox, monkeypatch):
    monkeypatch.setenv("TUNELAB_TEST_SECRET", "hunter2")
    text, kind, _ = run(sandbox, "import os; print(dict(os.environ))")
    assert kind is None and "hunter2" not in text and "TUNELAB_TEST_SECRET" not in text
    assert os.environ["TUNELAB_TEST_SECRET"] == "hunter2"


@pytest.mark.parametrize(
    ("code", "kind", "says"),
    [
        ("while True: pass", "timeout", "CPU time"),
        ("x = bytearray(2 * 10**9)", "exception", "MemoryError"),
        ("while True: print('x' * 10000)", "sandbox", "more than 4096 bytes"),
        ("import socket", "exception", "does not allow import socket"),
        ("import os\nwhile True: os.fork()", "exception", "does not allow os.fork"),
        ("import subprocess; subprocess.run(['true'])", "exception", "does not allow"),
    ],
)
def test_sandbox_limits_end_as_tool_errors(sandbox, code, kind, says):
    text, got, seconds = run(sandbox, code)
    assert got == kind and says in text, text[-300:]
    assert seconds < 20  # under the wall-time limit


def test_sandbox_wall_time():
    text, kind, seconds = run(PythonSandbox(wall_seconds=0.5), "import time; time.sleep(60)")
    assert kind == "timeout" and "wall time" in text and seconds < 10


def test_parse_hermes_with_reasoning_and_parallel_calls():
    text = (
        "<think>\nTwo at once.\n</think>\n\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2\\"}"}</tool_call>'
    )
    message, calls = parse_assistant(text, "hermes", turn=2)
    assert message["reasoning_content"] == "Two at once." and message["content"] == ""
    assert [(c.name, c.arguments, c.id) for c in calls] == [
        ("calculator", {"expression": "1+1"}, "c00200000"),
        ("calculator", {"expression": "2"}, "c00200001"),
    ]
    message, calls = parse_assistant("<tool_call>{oops</tool_call>", "hermes", 0)
    assert calls[0].name == ""  # an unknown tool: the model reads why


def test_parse_llama3_and_mistral():
    _, calls = parse_assistant('{"name": "calculator", "parameters": {"expression": "3"}}',
                               "llama3_json", 0)  # fmt: skip
    assert calls[0].arguments == {"expression": "3"}
    message, calls = parse_assistant("The answer is 3.", "llama3_json", 0)
    assert not calls and message["content"] == "The answer is 3."
    _, calls = parse_assistant('[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "4"}}]',
                               "mistral", 0)  # fmt: skip
    assert calls[0].name == "calculator" and len(calls[0].id) == 9


def test_key_value_store_episode_and_reward():
    box = Toolbox([calculator], {"KeyValueStore": KeyValueStore})
    first = box.start({}, seed=3)
    again = box.start({}, seed=3)
    assert first.added_prompt == again.added_prompt  # seeded
    assert set(first.tools) == {"calculator", "get", "set"}
    env = first.environment
    a, b = env.wanted
    total = sum(
        int(call_tool(first.tools, ToolCall("get", {"key": k}, "c")).content) for k in (a, b)
    )
    assert env.reward() == 0.5
    call_tool(first.tools, ToolCall("set", {"key": "total", "value": total}, "c"))
    assert env.reward() == 1.0
    assert call_tool(first.tools, ToolCall("get", {"key": "zz"}, "c")).error == "exception"


class RaisingReset(Environment):
    def reset(self, row, seed):
        raise RuntimeError("no database")


class WrongType(Environment):
    def reset(self, row, seed):
        return 3


def test_a_broken_environment_is_one_line_naming_it():
    with pytest.raises(ConfigError, match="environment RaisingReset: reset raised RuntimeError"):
        Toolbox([], {"RaisingReset": RaisingReset}).start({}, 0)
    with pytest.raises(ConfigError, match="environment WrongType: reset returned int"):
        Toolbox([], {"WrongType": WrongType}).start({}, 0)
    with pytest.raises(ConfigError, match="names environment 'Nope'"):
        Toolbox([], {"WrongType": WrongType}).start({"environment": "Nope"}, 0)


def test_toolbox_from_config_nodes():
    box = Toolbox.from_nodes(
        [{"_component_": "tunelab.rl.agentic.calculator"},
         {"_component_": "tunelab.rl.agentic.PythonSandbox", "cpu_seconds": 2}],
        [{"_component_": "tunelab.rl.agentic.KeyValueStore", "num_keys": 3}],
    )  # fmt: skip
    assert set(box.shared) == {"calculator", "python"}
    assert len(box.start({}, 0).environment.store) == 3
    with pytest.raises(ConfigError, match="not an Environment subclass"):
        Toolbox.from_nodes([], [{"_component_": "tunelab.rl.agentic.calculator"}])


def test_tool_call_reward_reads_the_episode():
    from tunelab.rl.agentic.rewards import tool_call_reward

    def row(calls, errors):
        return {"episode": {"num_tool_calls": calls, "tool_errors": errors}}

    rows = [row(0, {}), row(1, {"unknown_tool": 1}), row(2, {"timeout": 1}), row(1, {})]
    assert tool_call_reward([""] * 4, [""] * 4, rows) == [0.0, 0.5, 1.0, 1.0]


def test_a_tool_whose_timed_out_calls_still_run_is_refused_until_one_returns():
    tools = Toolbox([sleeper("nap")]).shared
    hung = ToolCall("nap", {"seconds": 1.5}, "c")
    for _ in range(MAX_RUNNING_AFTER_TIMEOUT):  # each leaves a thread running for 1.5 s
        assert _timed_call(tools, hung, 0.05).error == "timeout"
    start = time.perf_counter()
    refused = _timed_call(tools, ToolCall("nap", {"seconds": 0}, "c"), 5.0)
    assert refused.error == "timeout" and "are still running" in refused.content
    assert time.perf_counter() - start < 0.5  # refused at once, no third thread
    time.sleep(2.0)  # the hung calls return
    assert _timed_call(tools, ToolCall("nap", {"seconds": 0}, "c"), 5.0).content == "woke"
