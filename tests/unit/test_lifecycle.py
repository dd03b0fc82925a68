"""tunelab.lifecycle on its own: the output_dir lock, dying with the launcher, stop signals.

Each behaviour that involves signals or process death runs in a small subprocess of its own,
so the test process keeps its handlers and its life.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tunelab.errors import CheckpointError
from tunelab.lifecycle import LOCK_FILE_NAME, check_output_dir_free, lock_output_dir

ENV = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
for name in ("RANK", "WORLD_SIZE", "TUNELAB_LAUNCHER_PID", "TORCHELASTIC_RUN_ID"):
    ENV.pop(name, None)

HOLD_LOCK = """
import sys, time
from tunelab.lifecycle import lock_output_dir
lock_output_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(300)
"""


def _python(code: str, *args, env=None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        env=env or ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_dead(pid: int, timeout_s: float) -> float:
    start = time.monotonic()
    while _alive(pid):
        assert time.monotonic() - start < timeout_s, f"pid {pid} still alive"
        time.sleep(0.02)
    return time.monotonic() - start


# --- the output_dir lock ---------------------------------------------------------------------


def test_a_held_output_dir_is_refused_naming_the_holder_and_freed_when_it_is_killed(tmp_path):
    out = tmp_path / "run"
    holder = _python(HOLD_LOCK, out)
    try:
        assert holder.stdout.readline() == "locked\n"
        info = json.loads((out / LOCK_FILE_NAME).read_text())
        assert info["pid"] == holder.pid and info["host"] == socket.gethostname()
        with pytest.raises(CheckpointError) as launcher_check:
            check_output_dir_free(out)
        message = str(launcher_check.value)
        assert f"output_dir {out} is in use by another run" in message
        assert f"host {info['host']}, pid {holder.pid}, started {info['started']}" in message
        with pytest.raises(CheckpointError, match=f"pid {holder.pid}"):
            lock_output_dir(out)  # The recipes' path (world size 1 here).
        assert json.loads((out / LOCK_FILE_NAME).read_text()) == info  # Not overwritten.
    finally:
        holder.send_signal(signal.SIGKILL)  # The kernel drops a killed process's flock.
        holder.wait()
    check_output_dir_free(out)
    lock_output_dir(out)
    lock_output_dir(out)  # Held by this process already: nothing to do.
    assert json.loads((out / LOCK_FILE_NAME).read_text())["pid"] == os.getpid()
    other = subprocess.run(  # Another process sees this one as the holder.
        [sys.executable, "-c", HOLD_LOCK, str(out)], env=ENV, capture_output=True, text=True
    )
    assert other.returncode != 0 and f"pid {os.getpid()}" in other.stderr
    with pytest.raises(CheckpointError):
        check_output_dir_free(out)


def test_checking_a_missing_output_dir_creates_nothing(tmp_path):
    check_output_dir_free(tmp_path / "new")
    assert not (tmp_path / "new").exists()


# --- workers die with their launcher -----------------------------------------------------------

# A "launcher" that starts a "worker" (which calls exit_with_launcher) and waits to be killed.
LAUNCHER = """
import os, subprocess, sys, time
env = dict(os.environ, TUNELAB_LAUNCHER_PID=str(os.getpid()))
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env)
print(worker.pid, flush=True)
time.sleep(300)
"""
WORKER = """
import os, sys, time
from tunelab.lifecycle import parent_death
if {force_polling}:
    parent_death.set_parent_death_signal = lambda signum: False
parent_death.exit_with_launcher()
assert "TUNELAB_LAUNCHER_PID" not in os.environ  # Its own children must not inherit it.
open(sys.argv[1] if len(sys.argv) > 1 else os.devnull, "w").close()
time.sleep(300)
"""


@pytest.mark.parametrize("force_polling", [False, True], ids=["prctl", "polling_thread"])
def test_a_worker_dies_within_a_second_of_its_launcher_sigkill(force_polling):
    launcher = _python(LAUNCHER, WORKER.format(force_polling=force_polling))
    worker_pid = int(launcher.stdout.readline())
    time.sleep(1.5)  # Past the worker's start-up (the import of tunelab).
    assert _alive(worker_pid)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    assert _wait_dead(worker_pid, timeout_s=5) < 1.5


def test_a_worker_whose_launcher_died_before_it_started_exits_at_once():
    # TUNELAB_LAUNCHER_PID names a process that is not the parent: the launcher is gone.
    env = dict(ENV, TUNELAB_LAUNCHER_PID=str(os.getpid() + 10_000_000))
    worker = _python(WORKER.format(force_polling=False), env=env)
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == -signal.SIGKILL
    assert "launcher (pid" in stderr and "is gone; exiting" in stderr


def test_a_process_started_by_hand_is_left_alone(tmp_path):
    marker = tmp_path / "started"
    worker = _python(WORKER.format(force_polling=False), marker)  # No launcher variables.
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.05)
        assert worker.poll() is None
    finally:
        worker.kill()
        worker.wait()


# --- stop signals --------------------------------------------------------------------------------

PREEMPTION = """
import os, signal, sys, time
from tunelab.lifecycle import Preemption, TrainingStopped, install_stop_handlers, signal_received

class Checkpoints:
    output_dir = "/tmp/run"
    def save(self, step, epoch, progress, *, blocking=False):
        print("save", step, epoch, progress, blocking, flush=True)
    def wait(self):
        print("wait", flush=True)
    def close(self):
        print("close checkpoints", flush=True)

class Loggers:
    def close(self):
        print("close loggers", flush=True)

install_stop_handlers()
mode = sys.argv[1]
if mode == "before_loop":
    print("ready", flush=True)
    time.sleep(60)
preemption = Preemption(Checkpoints(), close=[Loggers()])
assert not preemption.stop_agreed()
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGINT)  # Within the repeat window: the same stop.
time.sleep(0.1)
assert signal_received() == signal.SIGTERM
assert preemption.stop_agreed()
if mode == "second_signal":
    print("ready", flush=True)
    time.sleep(60)
try:
    preemption.stop(7, 1, {"sampler": 3}, saved=mode == "saved")
except TrainingStopped as stop:
    print(stop.exit_code, stop.message, flush=True)
"""


@pytest.mark.parametrize("saved", [False, True])
def test_a_stop_in_the_loop_saves_synchronously_closes_and_raises(saved):
    process = _python(PREEMPTION, "saved" if saved else "unsaved")
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    first = "wait" if saved else "save 7 1 {'sampler': 3} True"
    assert stdout.splitlines() == [
        first,
        "close checkpoints",
        "close loggers",
        "143 stopped by SIGTERM at step 7; checkpoint step_7 committed; "
        "resume with checkpoint.resume_from_checkpoint=true",
    ]


def _signal_when_ready(mode: str, signum: int, *, rank: str = "0"):
    process = _python(PREEMPTION, mode, env=dict(ENV, RANK=rank))
    assert process.stdout.readline() == "ready\n"
    if mode == "second_signal":
        time.sleep(2.2)  # Past the repeat window of the first signal.
    start = time.monotonic()
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=60)
    return process.returncode, stdout, stderr, time.monotonic() - start


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_before_the_loop_exits_at_once_with_one_line(signum):
    code, stdout, stderr, seconds = _signal_when_ready("before_loop", signum)
    assert code == 128 + signum and seconds < 5
    assert stdout == f"stopped by {signal.Signals(signum).name} before training started\n"
    assert stderr == ""


def test_only_rank_0_prints_the_line():
    code, stdout, stderr, _ = _signal_when_ready("before_loop", signal.SIGTERM, rank="1")
    assert (code, stdout, stderr) == (143, "", "")


def test_a_second_signal_exits_at_once_without_a_checkpoint():
    from tunelab.lifecycle.preemption import stopping_notice

    code, stdout, stderr, seconds = _signal_when_ready("second_signal", signal.SIGINT)
    assert code == 130 and seconds < 5
    assert stdout == "stopped by a second signal (SIGINT): no checkpoint\n"
    # No launcher here (plain torchrun, or by hand): rank 0 said what the first one does.
    assert stderr == f"\n{stopping_notice(signal.SIGTERM)}\n"
    assert stopping_notice(signal.SIGTERM) == (
        "tunelab: SIGTERM: stopping at the next step boundary (with a checkpoint); "
        "send SIGTERM again or press Ctrl-C to stop at once"
    )


def test_under_tunelab_run_a_worker_leaves_the_signal_lines_to_the_launcher(tmp_path):
    # tunelab run prints the first signal's notice and the second's line itself (a worker
    # that hangs cannot); a second signal that reached the workers alone leaves its line in
    # the stop line file for the launcher to print.
    stop_line = tmp_path / "stop_line"
    env = dict(ENV, RANK="0", TUNELAB_LAUNCHER_REPORTS="1", TUNELAB_STOP_LINE_FILE=str(stop_line))
    process = _python(PREEMPTION, "second_signal", env=env)
    assert process.stdout.readline() == "ready\n"
    time.sleep(2.2)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert (process.returncode, stdout, stderr) == (130, "", "")
    assert stop_line.read_text() == "stopped by a second signal (SIGINT): no checkpoint"


def test_children_started_with_stop_signals_blocked_get_them_when_ready(tmp_path):
    from tunelab.lifecycle import stop_signals_blocked

    child_code = """
    import signal, time
    blocked = next(l for l in open("/proc/self/status") if l.startswith("SigBlk:"))
    print(int(blocked.split()[1], 16) & (1 << (signal.SIGTERM - 1)) != 0, flush=True)
    time.sleep(1)  # The signal comes now, and waits.
    from tunelab.lifecycle import install_stop_handlers
    install_stop_handlers()
    time.sleep(30)
    """
    with stop_signals_blocked():
        child = _python(child_code)
    assert child.stdout.readline() == "True\n"
    child.send_signal(signal.SIGTERM)
    stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 143, stderr
    assert stdout == "stopped by SIGTERM before training started\n"
    assert "Traceback" not in stderr


HELPER_OF_A_WORKER = """
import multiprocessing, os, signal, sys, time
from tunelab.lifecycle.preemption import leave_stop_signals_to_parent, stop_signals_blocked


def helper():  # A DataLoader worker of a recipe's rank, say: a forked multiprocessing child.
    leave_stop_signals_to_parent()
    time.sleep(60)
    os._exit(3)


if __name__ == "__main__":
    with stop_signals_blocked():
        process = multiprocessing.get_context("fork").Process(target=helper, daemon=True)
        process.start()
    print(process.pid, flush=True)
    if sys.argv[1] == "exit":
        os._exit(0)  # At once: maybe before the helper has even looked for its parent.
    for line in sys.stdin:  # "stop": the parent stops its helper, as DataLoader's shutdown does.
        process.terminate()  # SIGTERM
        process.join()
        print(process.exitcode, flush=True)
"""


def test_a_workers_helper_leaves_stop_signals_to_the_worker_but_obeys_it():
    # torchrun signals a worker's whole process group and SLURM every process: a streaming
    # rank's read-ahead worker got SIGTERM too and died of it, failing the rank's next step.
    worker = subprocess.Popen(
        [sys.executable, "-c", HELPER_OF_A_WORKER, "stop"], env=ENV, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        helper = int(worker.stdout.readline())
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):  # from another process
            subprocess.run(["kill", f"-{signum.name.removeprefix('SIG')}", str(helper)], check=True)
        time.sleep(1)
        assert _running(helper)  # Not killed, and not a zombie.
        worker.stdin.write("stop\n")
        worker.stdin.flush()
        assert worker.stdout.readline() == "0\n"  # Its parent's SIGTERM ends it at once.
    finally:
        worker.kill()
        worker.communicate()


def test_a_workers_helper_exits_when_the_worker_is_gone():
    worker = subprocess.Popen(
        [sys.executable, "-c", HELPER_OF_A_WORKER, "exit"], env=ENV, text=True,
        stdout=subprocess.PIPE,
    )  # fmt: skip
    helper = int(worker.stdout.readline())
    worker.wait(30)
    deadline = time.monotonic() + 10
    while _running(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(helper)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- recipe_main turns a stop into one line and 128 + signal ---------------------------------

TOY_RECIPE = """
import os, signal, time
from dataclasses import dataclass

from tunelab.config import RecipeArgs
from tunelab.lifecycle import recipe_main
from tunelab.lifecycle import Preemption


@dataclass(kw_only=True)
class ToyArgs(RecipeArgs):
    mode: str
    \"\"\"What to do after the stop signal.\"\"\"


class Checkpoints:
    output_dir = "/tmp/run"
    def save(self, step, epoch, progress, *, blocking=False): pass
    def wait(self): pass
    def close(self): pass


def main(args):
    preemption = Preemption(Checkpoints())
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
    if args.mode == "agreed" and preemption.stop_agreed():
        preemption.stop(5, 0, {}, saved=False)
    if args.mode == "error":  # What a peer that exited on the signal does to a collective.
        raise RuntimeError("Connection closed by peer\\nsecond line")
    print("returned", flush=True)  # mode "after": the loop had ended.


if __name__ == "__main__":
    recipe_main(main, ToyArgs)
"""


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (
            "agreed",
            "stopped by SIGTERM at step 5; checkpoint step_5 committed; "
            "resume with checkpoint.resume_from_checkpoint=true\n",
        ),
        (
            "error",
            "stopped by SIGTERM before a checkpoint was committed "
            "(RuntimeError: Connection closed by peer)\n",
        ),
        ("after", "returned\nstopped by SIGTERM after training ended\n"),
    ],
    ids=["agreed", "error", "after"],
)
def test_recipe_main_ends_a_stopped_run_with_one_line_and_143(tmp_path, mode, expected):
    (tmp_path / "toy.py").write_text(TOY_RECIPE)
    (tmp_path / "toy.yaml").write_text(f"recipe: toy.py\nmode: {mode}\n")
    result = subprocess.run(
        [sys.executable, str(tmp_path / "toy.py"), "--config", str(tmp_path / "toy.yaml")],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 143, result.stderr
    assert result.stdout == expected
    assert "Traceback" not in result.stderr


def test_a_worker_runs_its_recipe_as_python_recipe_would_with_fewer_collections(tmp_path):
    """``tunelab run``'s worker start (worker_start): the recipe file is ``__main__`` with the
    ``sys.argv`` and ``sys.path[0]`` of ``python recipe.py``, imports a module beside it, and
    runs its imports with the raised threshold, which ``restore_collector`` puts back."""
    from tunelab.lifecycle.worker_start import IMPORT_THRESHOLD, worker_arguments

    recipes = tmp_path / "my recipes"
    recipes.mkdir()
    (recipes / "helper.py").write_text("VALUE = 7\n")
    recipe = recipes / "recipe.py"
    recipe.write_text(
        textwrap.dedent(
            """
            import gc, json, sys
            import helper
            from tunelab.lifecycle.worker_start import restore_collector
            during = gc.get_threshold()
            restore_collector()
            restore_collector()  # a second call changes nothing
            print(json.dumps({
                "name": __name__, "argv": sys.argv, "path0": sys.path[0], "helper": helper.VALUE,
                "during": during, "after": gc.get_threshold(),
            }))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, *worker_arguments(str(recipe), ["--config", "x.yaml", "a=1"])],
        env=ENV, capture_output=True, text=True, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["name"] == "__main__" and seen["helper"] == 7
    assert seen["argv"] == [str(recipe), "--config", "x.yaml", "a=1"]
    assert seen["path0"] == str(recipes)
    defaults = list(subprocess.run(
        [sys.executable, "-c", "import gc; print(*gc.get_threshold())"],
        capture_output=True, text=True, check=True,
    ).stdout.split())  # fmt: skip
    assert seen["during"] == [IMPORT_THRESHOLD, *map(int, defaults[1:])]
    assert seen["after"] == list(map(int, defaults))


def test_a_failing_recipe_started_as_a_worker_exits_as_it_would_by_itself(tmp_path):
    from tunelab.lifecycle.worker_start import worker_arguments

    recipe = tmp_path / "recipe.py"
    recipe.write_text("import sys\nsys.exit(3)\n")
    done = subprocess.run(
        [sys.executable, *worker_arguments(str(recipe), [])], env=ENV, capture_output=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 3
