"""``tunelab`` commands run by the tests' launch server (``tunelab.cli.launch_server``).

Real launches, served and cold (``COLD``): the same losses bit for bit, the same exit codes and
lines; a SIGTERM to the command's own process (served: the stand-in) stops the run with its
committed checkpoint, a SIGKILL to it takes the whole launch along, and a command whose server
is gone or refuses it runs cold.
"""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.recipes.conftest import (
    COLD,
    RECIPE_TIMEOUT_S,
    TUNELAB,
    _children,
    _cmdline,
    launch_server,
    launcher_pid,
    limit_file_size,
    losses_by_step,
    run_env,
)
from tests.recipes.test_lifecycle_runs import _alive
from tests.recipes.test_worker_zygote import (
    COMMON,
    STEPS,
    _kill,
    _naming,
    _output,
    _start,
    _wait_for_a_step,
)
from tunelab.cli.launch_server import start_server
from tunelab.lifecycle.worker_client import LAUNCH_SERVER_ENV
from tunelab.lifecycle.zygote import ZYGOTE_CODE

pytestmark = pytest.mark.slow

SERVED_LINE = "tunelab: debug: the launch server runs this command"


def _run(out: Path, *extra: str, nproc: int = 2, env: dict | None = None):
    launcher = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    return subprocess.run(
        [TUNELAB, "run", *launcher, "lora_finetune_distributed", "--config", "tiny/lora",
         f"output_dir={out}", *COMMON, *extra],
        capture_output=True, text=True, env=run_env(**(env or {})), timeout=RECIPE_TIMEOUT_S,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _served():
    if launch_server() is None:
        pytest.skip("TUNELAB_TEST_LAUNCH_SERVER=0")


@contextlib.contextmanager
def _long_run(out: Path, served: bool):
    """A long run after its first step: (its ``tunelab`` process, the process running it).

    Served: the launch server runs it and the first is its stand-in; cold (``COLD``): the same.
    """
    run = _start(out, "schedule.max_steps_per_epoch=null", "schedule.epochs=20",
                 env=None if served else COLD)  # fmt: skip
    try:
        _wait_for_a_step(run, out)
        launcher = launcher_pid(run.pid)
        assert (launcher != run.pid) == served, "served by the launch server, or cold"
        assert _children(run.pid)
        yield run, launcher
    finally:
        _kill(run)


def test_a_served_launch_trains_and_fails_as_a_cold_one(tmp_path, monkeypatch):
    # A library a test imported set a variable in this process (inductor's codecache sets
    # _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR): the tests' commands still get the server.
    monkeypatch.setenv("_SET_BY_AN_IMPORTED_LIBRARY", "1")
    served = _run(tmp_path / "served", "--debug")
    cold = _run(tmp_path / "cold", env=COLD)
    assert served.returncode == cold.returncode == 0, served.stderr[-3000:] + cold.stderr[-3000:]
    assert SERVED_LINE in served.stderr, served.stderr[-3000:]
    # The launcher's workers were forked from the zygote it forked from itself: no fallback.
    assert "without the zygote" not in served.stderr and "without the launch" not in served.stderr
    expected = losses_by_step(tmp_path / "cold")
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert losses_by_step(tmp_path / "served") == expected
    # One process (no torchrun): the same too.
    one = _run(tmp_path / "one", "schedule.batch_size=4", "--debug", nproc=1)
    one_cold = _run(tmp_path / "one_cold", "schedule.batch_size=4", nproc=1, env=COLD)
    assert one.returncode == one_cold.returncode == 0, one.stderr[-3000:]
    assert SERVED_LINE in one.stderr
    assert losses_by_step(tmp_path / "one") == losses_by_step(tmp_path / "one_cold")
    # A bad config: the same one line and exit code, before any process starts.
    bad = [_run(tmp_path / "bad", "optimizer.lr=oops", env=env) for env in ({}, COLD)]
    assert bad[0].returncode == bad[1].returncode == 1
    assert bad[0].stderr == bad[1].stderr and bad[0].stdout == bad[1].stdout
    assert bad[0].stderr.startswith("tunelab: error: ") and len(bad[0].stderr.splitlines()) == 1


# The launch process's own behaviour, served and cold (the other tests run served).
@pytest.mark.parametrize("served", [True, False], ids=["served", "cold"])
def test_sigterm_to_the_command_stops_the_run_at_a_committed_checkpoint(tmp_path, served):
    out = tmp_path / "run"
    with _long_run(out, served) as (run, launcher):
        # Its zygote is the launcher's own child; the workers are its children.
        zygotes = [pid for pid in _children(run.pid) if ZYGOTE_CODE.encode() in _cmdline(pid)]
        assert len(zygotes) == 1 and len(_children(zygotes[0])) == 2
        os.kill(run.pid, signal.SIGTERM)
        code = run.wait(RECIPE_TIMEOUT_S)
    output = _output(out)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    line = next(line for line in output.splitlines() if line.startswith("stopped by SIGTERM"))
    step = int(line.split(" at step ")[1].split(";")[0])
    assert f"checkpoint step_{step} committed" in line
    assert (out / f"step_{step}").is_dir()
    assert not _alive(launcher) and not [pid for pid in _naming(out) if _alive(pid)]


@pytest.mark.parametrize("served", [True, False], ids=["served", "cold"])
def test_a_killed_command_takes_its_launch_along(tmp_path, served):
    out = tmp_path / "run"
    with _long_run(out, served) as (run, launcher):
        workers = [pid for pid in _naming(out) if pid != run.pid]
        assert len(workers) == 2
        os.kill(run.pid, signal.SIGKILL)
        assert run.wait(RECIPE_TIMEOUT_S) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while (_alive(launcher) or any(map(_alive, workers))) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(launcher) and not any(map(_alive, workers)), "the launch outlived it"


def test_a_command_whose_server_is_gone_or_refuses_runs_cold(tmp_path):
    folder = tmp_path / "server"
    folder.mkdir()
    path = str(folder / "socket")
    server = start_server(path, run_env(**COLD))
    try:
        refused = _run(tmp_path / "refused", "--debug", nproc=1,
                       env={LAUNCH_SERVER_ENV: path, "OMP_NUM_THREADS": "2"})  # fmt: skip
    finally:
        server.kill()
        server.wait()
    assert refused.returncode == 0, refused.stderr[-3000:]
    assert SERVED_LINE not in refused.stderr
    assert (
        "tunelab: debug: command runs without the launch server: the command's environment "
        "differs from the launch server's in OMP_NUM_THREADS"
    ) in refused.stderr
    gone = _run(tmp_path / "gone", "--debug", env={LAUNCH_SERVER_ENV: path})
    assert gone.returncode == 0, gone.stderr[-3000:]
    assert SERVED_LINE not in gone.stderr
    assert "tunelab: debug: command runs without the launch server: ConnectionRefusedError" in (
        gone.stderr
    )


def test_a_served_command_keeps_its_resource_limits(tmp_path):
    # `ulimit -f` (here a preexec_fn) holds in the server's child as in the command's process:
    # its write of a file larger than the limit fails (EFBIG), as a cold one does.
    def copy(target: Path, limit: int | None, env: dict):
        return subprocess.run(
            [TUNELAB, "--debug", "cp", "lora_finetune_distributed", str(target)],
            capture_output=True, text=True, env=run_env(**env), timeout=RECIPE_TIMEOUT_S,
            preexec_fn=None if limit is None else limit_file_size(limit),
        )  # fmt: skip

    whole = copy(tmp_path / "whole.py", None, {})
    assert whole.returncode == 0 and SERVED_LINE in whole.stderr, whole.stderr
    size = (tmp_path / "whole.py").stat().st_size
    assert size > 4096
    for env in ({}, COLD):
        target = tmp_path / f"cut_{len(env)}.py"
        cut = copy(target, 4096, env)
        assert (SERVED_LINE in cut.stderr) == (not env), cut.stderr
        assert cut.returncode == 1 and "File too large" in cut.stderr.splitlines()[-1], cut.stderr
        assert list(tmp_path.glob("cut_*")) == []  # `tunelab cp` leaves no part of a copy
