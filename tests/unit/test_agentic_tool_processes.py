"""Plain function tools run in worker processes: a hung or crashing call is killed, never the rank.

One executor (one worker process) is shared by the tests, in order: each test leaves it as a
run would, and the next call must find a working worker again.
"""

import os
import threading
import time

import pytest

from tests.agentic_tool_faults import crash, sleep_forever, where
from tunelab.rl.agentic import Toolbox, ToolCall, calculator, call_tool
from tunelab.rl.agentic.tool_processes import ToolExecutor, runs_in_process

TIMEOUT_S = 1.0


TOOLS = Toolbox([sleep_forever, crash, where, calculator]).shared


@pytest.fixture(scope="module")
def executor():
    executor = ToolExecutor(TIMEOUT_S, num_processes=1, max_result_chars=300)
    yield executor
    executor.close()


def run(executor, name, **arguments):
    start = time.perf_counter()
    result = executor.call(TOOLS, ToolCall(name, arguments, "c"))
    return result, time.perf_counter() - start


def test_which_tools_run_in_a_process():
    assert runs_in_process(calculator) and runs_in_process(where)

    def local(x: int) -> str:
        """A closure.

        Args:
            x: A number.
        """
        return str(x)

    assert not runs_in_process(local) and not runs_in_process(lambda: "")
    assert not runs_in_process(Toolbox([]).start)  # a bound method: its instance's state


def test_calls_run_in_a_worker_and_equal_the_in_process_result(executor):
    result, _ = run(executor, "where", label="hi")
    label, pid = result.content.split()
    assert result.error is None and label == "hi" and int(pid) != os.getpid()
    for expression in ("(3 + 4) * 2", "1/0", "a + 1"):
        call = ToolCall("calculator", {"expression": expression}, "c")
        here, there = call_tool(TOOLS, call), executor.call(TOOLS, call)
        assert (there.content, there.error) == (here.content, here.error)


def test_a_hung_call_is_a_timeout_and_its_worker_is_killed_and_restarted(executor):
    before = run(executor, "where", label="a")[0].content.split()[1]
    result, seconds = run(executor, "sleep_forever", seconds=1)
    assert result.error == "timeout" and "took longer than 1 s" in result.content
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 5
    with pytest.raises(ProcessLookupError):
        os.kill(int(before), 0)  # killed, not left running
    after = run(executor, "where", label="b")[0]
    assert after.error is None and after.content.split()[1] != before


@pytest.mark.parametrize(
    ("how", "kind", "says"),
    [
        ("exit", "crash", "crash crashed: its worker process exited with status 3"),
        ("segfault", "crash", "its worker process was killed by SIGSEGV"),
        ("raise", "exception", "crash raised RuntimeError: xxx"),
    ],
)
def test_a_crashing_call_is_an_error_the_model_reads(executor, how, kind, says):
    result, _ = run(executor, "crash", how=how)
    assert result.error == kind and says in result.content and result.seconds < TIMEOUT_S
    assert len(result.content) <= 300  # bounded before it leaves the worker
    assert run(executor, "where", label="next")[0].error is None  # a fresh worker took over


def test_threads_share_the_workers_and_none_hangs():
    executor = ToolExecutor(0.5, num_processes=2)
    outcomes = []
    threads = [
        threading.Thread(target=lambda: outcomes.append(run(executor, "sleep_forever", seconds=1)))
        for _ in range(4)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert [r.error for r, _ in outcomes] == ["timeout"] * 4
    assert time.perf_counter() - start < 15  # two rounds of two, each killed at 0.5 s
    assert run(executor, "where", label="x")[0].error is None
    executor.close()
