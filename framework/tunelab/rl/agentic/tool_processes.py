"""Tool calls under a time limit: plain functions in worker processes that can be killed.

A plain tool function (a module-level function, found again by its module and name) runs in
one of a few worker processes of the rank (``agentic.tool_processes``). A call that passes
its timeout has its worker killed (SIGKILL) and replaced by a fresh one; a call whose worker
dies (a segfault, ``os._exit``, the kernel's OOM killer) is a ``crash``. Either way the model
reads the error as the tool's message and the rank goes on: a hung or crashing tool never
hangs the run. A call is a function of its arguments only, so where it runs changes no result
and a resumed run replays the same ones.

Calls and results cross the pipe as JSON (the tool's module and qualified name, its schema, the
call; the result's text and error kind): no call or result is pickled. The workers are forked
from a ``forkserver`` process (a fresh interpreter, started at the
first call, that imports the recipe, ``tunelab.rl.agentic.tools`` and the tools' modules once),
not from the training process with its threads and process groups: starting or restarting a
worker takes milliseconds. They are daemons of the rank (stopped when it exits) and ask the
kernel to kill them when the forkserver, which exits with the rank, dies.

Everything else runs in a thread of the training process, as environments' tools must (they
are methods over their episode's state there) and as tool sets do (a class whose instance keeps
state, such as ``PythonSandbox``, which kills its own process group at its wall-time limit),
and as closures and lambdas do (they cannot be found by name): Python cannot stop a thread, so
such a call that times out keeps running; while :data:`MAX_RUNNING_AFTER_TIMEOUT` timed-out
calls of one tool still run, its further calls fail at once as timeouts until one returns.
"""

from __future__ import annotations

import importlib
import inspect
import json
import multiprocessing
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

from tunelab.rl.agentic.tools import Tool, ToolCall, ToolResult, call_tool

__all__ = ["MAX_RUNNING_AFTER_TIMEOUT", "ToolExecutor", "runs_in_process"]

MAX_RUNNING_AFTER_TIMEOUT = 2
"""Timed-out calls of one thread-run tool that may still run before its further calls are refused."""

START_TIMEOUT_S = 300.0
"""Seconds a worker may take to start and import a tool's module (the first call starts the
forkserver, which imports the recipe) before the call fails as a ``timeout``."""

_running_after_timeout: dict[str, list[threading.Thread]] = {}
_running_lock = threading.Lock()


def runs_in_process(function: Callable[..., Any]) -> bool:
    """Whether a tool's function can run in a worker process: a plain function found by name.

    Bound methods (environments, tool sets), closures and lambdas run in threads.
    """
    if not inspect.isfunction(function) or "<" in function.__qualname__:
        return False
    found: Any = sys.modules.get(function.__module__)
    for part in function.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is function


class ToolExecutor:
    """Runs an episode's tool calls under ``timeout_s``, each where it can be stopped.

    Args:
        timeout_s: Seconds one call may take.
        num_processes: Worker processes for plain function tools (started at their first
            call); 0 runs every tool in a thread.
        max_result_chars: Longest result a worker sends back (the runner cuts it again, with a
            marker).

    Thread-safe: the runner's threads call :meth:`call` at once; a call waits for a free
    worker (at most ``num_processes`` run), and its time limit starts when it is sent.
    """

    def __init__(self, timeout_s: float, num_processes: int = 2, max_result_chars: int = 2000):
        self.timeout_s = timeout_s
        self.num_processes = num_processes
        self.max_result_chars = max_result_chars
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(num_processes):
            self._idle.put(None)  # a slot; its worker starts on first use
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.workers_started = 0

    def call(self, tools: Mapping[str, Any], call: ToolCall) -> ToolResult:
        """Run one call; every failure (a timeout and a crash included) is a result.

        Args:
            tools: The episode's tools by name (``Tool``).
            call: The parsed call.

        Returns:
            The result, with ``seconds`` the call's wall time.
        """
        tool = tools.get(call.name)
        if self.num_processes == 0 or tool is None or not runs_in_process(tool.function):
            return timed_thread_call(tools, call, self.timeout_s)
        worker = self._idle.get()
        try:
            if worker is None or not worker.process.is_alive():
                worker = self._start()
            if isinstance(worker, ToolResult):
                result, worker = worker, None
            else:
                result = worker.run(tool, call, self.timeout_s)
                if not worker.process.is_alive():
                    worker = None  # killed at its timeout, or crashed: the slot starts anew
        finally:
            self._idle.put(worker)
        return result

    def _start(self) -> _Worker | ToolResult:
        try:
            worker = _Worker(_context(), self.max_result_chars)
        except Exception as error:  # the forkserver failed to start: the call fails, not the run
            return ToolResult(
                f"Error: the tool worker process did not start: {type(error).__name__}: {error}",
                "crash",
            )
        with self._lock:
            self._workers = [w for w in self._workers if w.process.is_alive()] + [worker]
            self.workers_started += 1
        return worker

    def close(self) -> None:
        """Kill every worker process (they are daemons: the rank's exit stops them too)."""
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.kill()


class _Worker:
    """One worker process and the pipe its calls go through."""

    def __init__(self, context: Any, max_result_chars: int) -> None:
        connection, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, max_result_chars), daemon=True, name="tunelab-tool"
        )
        self.process.start()
        child.close()
        self.connection: Connection = connection

    def run(self, tool: Any, call: ToolCall, timeout_s: float) -> ToolResult:
        start = time.perf_counter()
        function = tool.function
        request = {
            "module": function.__module__,
            "qualname": function.__qualname__,
            "name": tool.name,
            "schema": tool.schema,
            "call": {"name": call.name, "arguments": call.arguments, "id": call.id},
        }
        try:
            message = json.dumps(request).encode()
        except (TypeError, ValueError) as error:  # a schema that is no JSON: said, not raised
            return ToolResult(
                f"Error: {call.name} cannot be sent to a worker process: {error}", "exception"
            )
        try:
            self.connection.send_bytes(message)
            # Starting the worker and importing the tool's module are not the call's time.
            if self.connection.poll(START_TIMEOUT_S):
                self.connection.recv_bytes()  # the worker took the call
                start = time.perf_counter()
                if self.connection.poll(timeout_s):
                    content, error = json.loads(self.connection.recv_bytes())
                    return ToolResult(content, error, time.perf_counter() - start)
            else:
                timeout_s = START_TIMEOUT_S
        except (EOFError, OSError):  # it died during the call
            self.process.join(timeout=5.0)
            ended = _how_it_ended(self.process)
            self.kill()
            return ToolResult(
                f"Error: {call.name} crashed: its worker process {ended}",
                "crash",
                time.perf_counter() - start,
            )
        self.kill()
        return ToolResult(
            f"Error: {call.name} took longer than {timeout_s:g} s (stopped)",
            "timeout",
            time.perf_counter() - start,
        )

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.connection.close()


def _how_it_ended(process: Any) -> str:
    code = process.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


_CONTEXT: Any = None
_context_lock = threading.Lock()


def _context() -> Any:
    """The forkserver context (spawn where there is none), its preloads set before it starts."""
    global _CONTEXT
    with _context_lock:
        if _CONTEXT is not None:
            return _CONTEXT
        methods = multiprocessing.get_all_start_methods()
        _CONTEXT = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            # Imported once by the server, inherited by every worker it forks (no effect when
            # another user of the forkserver started it already: workers then import them).
            _CONTEXT.set_forkserver_preload(["__main__", __name__])
        return _CONTEXT


def _serve(connection: Connection, max_result_chars: int) -> None:
    """A worker's loop: receive a JSON call, send ``[content, error]``, until the pipe closes."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the rank's to handle
    while True:
        try:
            message = connection.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            tool, call = _decode(message)
        except Exception as error:  # the tool's module does not import here
            connection.send_bytes(b"")
            content = f"Error: the tool could not be loaded: {type(error).__name__}: {error}"
            _reply(connection, content[:max_result_chars], "exception")
            continue
        connection.send_bytes(b"")  # taken: the call's time starts
        result = call_tool({tool.name: tool}, call)
        _reply(connection, result.content[:max_result_chars], result.error)


def _decode(message: bytes) -> tuple[Tool, ToolCall]:
    """The tool (its function found again by module and qualified name) and the call."""
    request = json.loads(message)
    module = sys.modules.get(request["module"]) or importlib.import_module(request["module"])
    function: Any = module
    for part in request["qualname"].split("."):
        function = getattr(function, part)
    return Tool(request["name"], request["schema"], function), ToolCall(**request["call"])


def _reply(connection: Connection, content: str, error: str | None) -> None:
    connection.send_bytes(json.dumps([content, error]).encode())


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when its parent (the forkserver) dies."""
    if sys.platform != "linux":
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def timed_thread_call(tools: Mapping[str, Any], call: ToolCall, timeout_s: float) -> ToolResult:
    """``call_tool`` in a daemon thread, waited on for ``timeout_s``.

    Python cannot stop a thread, so a call that hangs keeps running after its timeout. The
    damage is bounded: while :data:`MAX_RUNNING_AFTER_TIMEOUT` timed-out calls of a tool still
    run, its further calls fail at once as timeouts, so hung threads never pile up; a call is
    taken again once one of them has returned.
    """
    with _running_lock:
        running = [t for t in _running_after_timeout.get(call.name, []) if t.is_alive()]
        _running_after_timeout[call.name] = running
    if len(running) >= MAX_RUNNING_AFTER_TIMEOUT:
        return ToolResult(
            f"Error: {call.name} is unavailable: {len(running)} earlier calls that took longer "
            f"than {timeout_s:g} s are still running",
            "timeout",
            0.0,
        )
    outcome: list[ToolResult] = []
    start = time.perf_counter()
    thread = threading.Thread(target=lambda: outcome.append(call_tool(tools, call)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    seconds = time.perf_counter() - start
    if not outcome:
        with _running_lock:
            _running_after_timeout.setdefault(call.name, []).append(thread)
        return ToolResult(
            f"Error: {call.name} took longer than {timeout_s:g} s", "timeout", seconds
        )
    return ToolResult(outcome[0].content, outcome[0].error, seconds)
