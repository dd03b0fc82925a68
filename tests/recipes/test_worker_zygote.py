"""torchrun's workers forked from the launch's zygote (``tunelab.lifecycle.zygote``).

Real ``tunelab run`` launches on 2 processes: the forked workers train exactly as workers that
import everything themselves (``TUNELAB_WORKER_ZYGOTE=0``), each launch has a zygote of its own,
a worker whose stand-in torchrun killed dies too, and a recipe whose import fails fails as it
always did.
"""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.recipes.conftest import (
    RECIPE_TIMEOUT_S,
    TUNELAB,
    _children,
    _cmdline,
    launcher_pid,
    losses_by_step,
    run_env,
)
from tests.recipes.test_lifecycle_runs import _alive
from tunelab import _paths
from tunelab.lifecycle.zygote import ZYGOTE_CODE, ZYGOTE_ENV

pytestmark = pytest.mark.slow

STEPS = 6
COMMON = [
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "lr_scheduler.num_warmup_steps=0",
    "~val_dataset",
    "checkpoint.save_every_n_steps=1000",
]


def _start(out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [TUNELAB, "run", "--nproc_per_node", "2", "lora_finetune_distributed", "--config",
         "tiny/lora", f"output_dir={out}", *COMMON, *extra],
        stdout=log, stderr=subprocess.STDOUT, env=run_env(**(env or {})), start_new_session=True,
    )  # fmt: skip


def _output(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text(errors="replace")


def _environ(pid: int) -> dict[bytes, bytes]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.split(b"=", 1) for entry in entries if b"=" in entry)


def _naming(out: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and str(out).encode() in _cmdline(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def _has_a_step(out: Path) -> bool:
    path = out / "logs" / "metrics.jsonl"
    return path.exists() and b'"loss"' in path.read_bytes()


def _wait_for_a_step(run: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + RECIPE_TIMEOUT_S
    while not _has_a_step(out):
        assert run.poll() is None, _output(out)
        assert time.monotonic() < deadline, "no step in time"
        time.sleep(0.05)


def _kill(*runs: subprocess.Popen) -> None:
    for run in runs:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()


def _tree(run: subprocess.Popen, out: Path) -> tuple[list[int], list[int], list[int]]:
    """The launch's zygotes, the stand-ins torchrun started, and the workers naming ``out``."""
    children = _children(run.pid)
    zygotes = [pid for pid in children if ZYGOTE_CODE.encode() in _cmdline(pid)]
    workers = sorted(pid for pid in _naming(out) if pid != run.pid)
    return zygotes, [pid for pid in children if pid not in zygotes], workers


def test_concurrent_launches_fork_from_zygotes_of_their_own_and_train_as_without_one(tmp_path):
    first, second, alone = tmp_path / "first", tmp_path / "second", tmp_path / "alone"
    runs = [_start(first), _start(second)]
    try:
        trees = []
        for run, out in zip(runs, (first, second), strict=True):
            _wait_for_a_step(run, out)
            # Checked while this run still trains: the first may end while the second starts.
            zygotes, clients, workers = _tree(run, out)
            forked = sorted(_children(zygotes[0])) if len(zygotes) == 1 else None
            assert len(zygotes) == 1 and len(clients) == 2, (zygotes, clients)
            # The workers are the zygote's children, each named once by its command line (the
            # stand-ins hide theirs), and /proc shows each its own rank's environment.
            assert forked == workers, (workers, forked)
            assert sorted(_environ(pid)[b"RANK"] for pid in workers) == [b"0", b"1"]
            assert not set(clients) & set(workers)
            trees.append((zygotes, clients, workers))
        assert trees[0][0] != trees[1][0]  # A zygote each.
        codes = [run.wait(RECIPE_TIMEOUT_S) for run in runs]
    finally:
        _kill(*runs)
    assert codes == [0, 0], _output(first) + _output(second)
    assert not _naming(first) and not _naming(second)
    # Without a zygote each worker imports everything itself: the same losses, bit for bit.
    run = _start(alone, env={ZYGOTE_ENV: "0"})
    try:
        _wait_for_a_step(run, alone)
        zygotes, clients, workers = _tree(run, alone)
        assert zygotes == [] and sorted(clients) == workers and len(workers) == 2
        code = run.wait(RECIPE_TIMEOUT_S)
    finally:
        _kill(run)
    assert code == 0, _output(alone)
    expected = losses_by_step(alone)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert losses_by_step(first) == expected and losses_by_step(second) == expected


def test_a_killed_stand_in_takes_its_worker_along(tmp_path):
    out = tmp_path / "run"
    run = _start(out, "schedule.max_steps_per_epoch=null", "schedule.epochs=20")
    try:
        _wait_for_a_step(run, out)
        _, clients, workers = _tree(run, out)
        assert len(clients) == 2 and len(workers) == 2
        # The stand-in names its worker; torchrun is frozen, so only the zygote can act.
        title = _cmdline(clients[0]).split(b"\0")[0].decode()
        worker = int(re.fullmatch(r"tunelab worker client \(worker pid (\d+)\)", title)[1])
        other = next(pid for pid in workers if pid != worker)
        launcher = launcher_pid(run.pid)  # Not its stand-in, when the launch server runs it.
        os.kill(launcher, signal.SIGSTOP)
        try:
            os.kill(clients[0], signal.SIGKILL)  # As torchrun does to a worker that will not stop.
            killed = time.monotonic()
            while _alive(worker) and time.monotonic() - killed < 30:
                time.sleep(0.05)
            gone, other_alive = not _alive(worker), _alive(other)
        finally:
            os.kill(launcher, signal.SIGCONT)
        code = run.wait(RECIPE_TIMEOUT_S)
    finally:
        _kill(run)
    assert gone and other_alive, "the zygote left the worker of a dead stand-in running"
    assert code == 128 + signal.SIGKILL, _output(out)
    assert "killed by SIGKILL, signal 9" in _output(out)
    assert not _naming(out)


def test_a_recipe_import_the_zygote_could_not_make_fails_as_without_a_zygote(tmp_path):
    recipe = tmp_path / "broken.py"
    real = (_paths.recipes_dir() / "lora_finetune_distributed.py").read_text()
    recipe.write_text(f"import tunelab_no_such_module  # noqa\n{real}")
    results = {}
    for setting in ("1", "0"):
        out = tmp_path / f"run{setting}"
        results[setting] = subprocess.run(
            [TUNELAB, "run", "--nproc_per_node", "2", str(recipe), "--config", "tiny/lora",
             f"output_dir={out}", *COMMON],
            capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S,
            env=run_env(**{ZYGOTE_ENV: setting}),
        )  # fmt: skip
    errors = {
        setting: [line for line in result.stderr.splitlines() if line.startswith("tunelab: ")]
        for setting, result in results.items()
    }
    assert results["1"].returncode == results["0"].returncode == 1, results
    assert errors["1"] == errors["0"], errors
    assert len(errors["1"]) == 1 and errors["1"][0].startswith(
        "tunelab: error: recipe broken failed on rank "
    ), errors
    assert errors["1"][0].endswith(" (exit code 1)"), errors
    for result in results.values():
        assert "ModuleNotFoundError: No module named 'tunelab_no_such_module'" in result.stderr
