"""Tools that hang or crash, for the tool-process tests (importable by name in worker processes).

Kept apart from the test modules so that a fresh worker imports only this (the forkserver has
``tunelab.rl.agentic`` preloaded), not pytest.
"""

import os
import signal
import time
import zlib

from tunelab.rl.agentic import calculator as real_calculator


def sleep_forever(seconds: float) -> str:
    """Never return.

    Args:
        seconds: Ignored.
    """
    while True:
        time.sleep(3600)


def crash(how: str) -> str:
    """Kill the process running the tool.

    Args:
        how: "exit" (os._exit(3)), "segfault" (SIGSEGV) or "raise" (a long message).
    """
    if how == "exit":
        os._exit(3)
    if how == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    raise RuntimeError("x" * 100_000)


def where(label: str) -> str:
    """The process the call ran in.

    Args:
        label: Echoed.
    """
    return f"{label} {os.getpid()}"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2".
    """
    # The shipped calculator's schema and results, except that by a checksum of the call a
    # third of the calls never return and a third kill their process: a function of the call
    # only, so a resumed run replays the same failures.
    fault = zlib.crc32(expression.encode()) % 3
    if fault == 0:
        sleep_forever(0)
    if fault == 1:
        os._exit(1)
    return real_calculator(expression)


assert calculator.__doc__ == real_calculator.__doc__  # the prompt the policy was tuned on
