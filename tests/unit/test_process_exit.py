"""A process that imported tunelab freezes its heap at exit, after its own exit handlers ran."""

import subprocess
import sys

# The handler registered before tunelab's runs after it (atexit is last-in, first-out): by then
# the heap must be frozen, and a handler registered after the import still ran.
PROBE = """
import atexit, gc
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
import tunelab
atexit.register(lambda: print("later handler ran, frozen:", gc.get_freeze_count() > 0))
print("frozen while running:", gc.get_freeze_count() > 0)
"""


def test_the_heap_is_frozen_only_at_exit_and_every_exit_handler_runs():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    )
    assert result.stdout.splitlines() == [
        "frozen while running: False",
        "later handler ran, frozen: False",
        "frozen at exit: True",
    ], result.stdout + result.stderr
