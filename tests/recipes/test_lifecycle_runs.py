"""Process lifecycle end to end, with the real ``tunelab run`` on the embedded tiny model.

One run per output_dir (a lock), workers that die with their launcher (SIGKILL included),
and a SIGTERM or SIGINT that becomes a committed checkpoint at a step every rank agrees on,
from which a resume continues with the losses of an uninterrupted run.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.recipes.conftest import (
    TUNELAB,
    assert_same_exports,
    free_port,
    losses_by_step,
    run_env,
    tunelab_run,
)
from tunelab._paths import recipes_dir

pytestmark = pytest.mark.slow
STEPS = 24
# Global batch 16: 2 processes x 8, or 1 process x 16.
COMMON = [
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "lr_scheduler.num_warmup_steps=0",
    "~val_dataset",
    "checkpoint.keep_last_n_checkpoints=null",
]
BETWEEN_SAVES = "checkpoint.save_every_n_steps=1000"
STREAM_STEPS = 16  # tiny/stream_lora's data packs into 18 global batches of 16
STOP_LINE = re.compile(
    r"stopped by (SIGTERM|SIGINT) at step (\d+); checkpoint step_\2 committed; "
    r"resume with checkpoint\.resume_from_checkpoint=true"
)


def _overrides(out: Path, *extra: str, nproc: int = 2, steps: int = STEPS) -> list[str]:
    common = [arg.replace(f"={STEPS}", f"={steps}") for arg in COMMON]
    return [f"output_dir={out}", f"schedule.batch_size={16 // nproc}", *common, *extra]


class _Run:
    """A ``tunelab run`` in the background, its output in files (a full pipe would block it)."""

    def __init__(
        self,
        out: Path,
        *overrides: str,
        nproc: int = 2,
        recipe: str = "lora_finetune_distributed",
        config: str = "tiny/lora",
        env: dict[str, str] | None = None,
    ):
        self.out = out
        launcher = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
        command = [TUNELAB, "run", *launcher, recipe, "--config", config, *overrides]
        self._stdout = open(out.parent / f"{out.name}.stdout", "w+")  # noqa: SIM115
        self._stderr = open(out.parent / f"{out.name}.stderr", "w+")  # noqa: SIM115
        # A session of its own, so a leftover can be killed as a group whatever happens.
        self.process = subprocess.Popen(
            command, env=run_env(**(env or {})), stdout=self._stdout, stderr=self._stderr,
            start_new_session=True,
        )  # fmt: skip

    def stderr_so_far(self) -> str:
        return Path(self._stderr.name).read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.process.pid

    def workers(self) -> list[int]:
        """The worker processes: every other process whose command line names output_dir."""
        return _processes_naming(self.out, exclude={self.pid, os.getpid()})

    def wait_for_steps(self, count: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while len(_logged_steps(self.out)) < count:
            assert self.process.poll() is None, f"the run ended early:\n{self.finish()}"
            assert time.monotonic() < deadline, "no training steps in time"
            time.sleep(0.05)

    def finish(self, timeout_s: float = 300) -> tuple[int, str, str]:
        try:
            code = self.process.wait(timeout_s)
        finally:
            self.kill()
        self._stdout.seek(0)
        self._stderr.seek(0)
        return code, self._stdout.read(), self._stderr.read()

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for pid in self.workers():  # Never leave a worker behind, even when a test fails.
            os.kill(pid, signal.SIGKILL)


def _processes_naming(out: Path, exclude: set[int]) -> list[int]:
    needle = str(out).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in exclude:
            try:
                if needle in (entry / "cmdline").read_bytes() and _alive(int(entry.name)):
                    pids.append(int(entry.name))
            except OSError:
                continue  # It ended while we looked.
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _logged_steps(out: Path) -> list[int]:
    """Steps with a logged loss, in file order (a line still being written is skipped)."""
    path = out / "logs" / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            steps.append(record["step"])
    return steps


def _committed_steps(out: Path) -> list[int]:
    return sorted(
        int(path.parent.name.split("_")[1]) for path in out.glob("step_*/tunelab_manifest.json")
    )


def _assert_stopped(code: int, stdout: str, stderr: str, signum: int) -> int:
    """The run stopped on ``signum`` with exactly one line and no traceback; return its step."""
    assert code == 128 + signum, (code, stdout, stderr[-3000:])
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout
    match = STOP_LINE.fullmatch(lines[0])
    assert match and match.group(1) == signal.Signals(signum).name, lines[0]
    return int(match.group(2))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 2-process run: its losses and its export."""
    out = tmp_path_factory.mktemp("uninterrupted")
    tunelab_run("lora_finetune_distributed", "tiny/lora", *_overrides(out, BETWEEN_SAVES))
    assert sorted(losses_by_step(out)) == list(range(1, STEPS + 1))
    return out


def _assert_exact_resume(
    out: Path, step: int, reference: Path, *, nproc: int, tol: float | None,
    config: str = "tiny/lora", steps: int = STEPS,
):  # fmt: skip
    """The resumed run's later losses and its export equal the reference run's.

    ``tol`` None: bit for bit (the reference's world size); else the largest difference allowed
    in a loss and in an exported weight.
    """
    resumed = tunelab_run(
        "lora_finetune_distributed", config,
        *_overrides(
            out, BETWEEN_SAVES, "checkpoint.resume_from_checkpoint=true", nproc=nproc, steps=steps
        ),
        nproc=nproc,
    )  # fmt: skip
    assert f"finished at step {steps}" in resumed.stdout
    losses, expected = losses_by_step(out), losses_by_step(reference)
    for later in range(step + 1, steps + 1):
        assert abs(losses[later] - expected[later]) <= (tol or 0), (later, losses[later])
    assert_same_exports(out, reference, atol=tol)


# --- preemption -----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["launcher", "every_process"])
def test_sigterm_between_saves_commits_the_agreed_step_and_resume_is_exact(
    reference, tmp_path, target
):
    out = tmp_path / "run"
    run = _Run(out, *_overrides(out, BETWEEN_SAVES))
    try:
        run.wait_for_steps(3)
        # "every_process" is what SLURM does: each worker gets it directly and forwarded.
        for pid in [run.pid, *(run.workers() if target == "every_process" else [])]:
            os.kill(pid, signal.SIGTERM)
        code, stdout, stderr = run.finish()
    finally:
        run.kill()
    step = _assert_stopped(code, stdout, stderr, signal.SIGTERM)
    assert 3 <= step < STEPS
    assert _committed_steps(out) == [step]  # No scheduled save before it.
    assert max(_logged_steps(out)) == step  # It finished that step and did not start another.
    assert not run.workers()
    _assert_exact_resume(out, step, reference, nproc=2, tol=None)


@pytest.fixture(scope="module")
def stream_reference(tmp_path_factory) -> Path:
    """``tiny/stream_lora`` uninterrupted on 2 processes (streamed, packed, read-ahead workers)."""
    out = tmp_path_factory.mktemp("stream_uninterrupted")
    overrides = _overrides(out, BETWEEN_SAVES, steps=STREAM_STEPS)
    tunelab_run("lora_finetune_distributed", "tiny/stream_lora", *overrides)
    assert sorted(losses_by_step(out)) == list(range(1, STREAM_STEPS + 1))
    return out


@pytest.mark.parametrize("target", ["launcher", "every_process"])
def test_sigterm_to_a_streaming_run_commits_the_agreed_step_and_resume_is_exact(
    stream_reference, tmp_path, target
):
    # Each rank reads ahead in a DataLoader worker process: torchrun's signal to the rank's
    # process group (and SLURM's to every process) reaches that worker too. It used to die of
    # it, and the next step failed: "stopped by SIGTERM before a checkpoint was committed
    # (RuntimeError: DataLoader worker (pid ...) is killed by signal: Terminated.)".
    out = tmp_path / "run"
    overrides = _overrides(out, BETWEEN_SAVES, steps=STREAM_STEPS)
    run = _Run(out, *overrides, config="tiny/stream_lora")
    try:
        run.wait_for_steps(3)
        if target == "every_process":
            targets = run.workers()
            assert len(targets) >= 4, targets  # 2 ranks and their read-ahead workers
        else:
            targets = []
        for pid in [run.pid, *targets]:
            os.kill(pid, signal.SIGTERM)
        code, stdout, stderr = run.finish()
    finally:
        run.kill()
    step = _assert_stopped(code, stdout, stderr, signal.SIGTERM)
    assert 3 <= step < STREAM_STEPS and _committed_steps(out) == [step]
    assert max(_logged_steps(out)) == step
    assert not run.workers()  # The read-ahead workers ended with their ranks.
    _assert_exact_resume(
        out, step, stream_reference, nproc=2, tol=None, config="tiny/stream_lora",
        steps=STREAM_STEPS,
    )  # fmt: skip


def test_sigterm_to_a_one_process_run(reference, tmp_path):
    out = tmp_path / "run"
    run = _Run(out, *_overrides(out, BETWEEN_SAVES, nproc=1), nproc=1)
    try:
        run.wait_for_steps(3)
        run.process.send_signal(signal.SIGTERM)
        code, stdout, stderr = run.finish()
    finally:
        run.kill()
    step = _assert_stopped(code, stdout, stderr, signal.SIGTERM)
    assert _committed_steps(out) == [step] and step < STEPS
    # World size 1 against the 2-process reference: equal up to reduction order.
    _assert_exact_resume(out, step, reference, nproc=1, tol=1e-5)


def test_sigint_at_a_step_the_schedule_saves_waits_for_that_save(tmp_path):
    # Every step saves asynchronously: the stop step's own save is the checkpoint.
    out = tmp_path / "run"
    run = _Run(out, *_overrides(out, "checkpoint.save_every_n_steps=1"))
    try:
        run.wait_for_steps(3)
        run.process.send_signal(signal.SIGINT)
        code, stdout, stderr = run.finish()
    finally:
        run.kill()
    step = _assert_stopped(code, stdout, stderr, signal.SIGINT)
    assert _committed_steps(out) == list(range(1, step + 1))


@pytest.mark.parametrize(
    ("recipe", "config"),
    [
        ("full_finetune_distributed", "tiny/full"),
        ("lora_dpo_distributed", "tiny/lora_dpo"),
        ("grpo_distributed", "tiny/grpo"),
    ],
)
def test_the_other_training_recipes_stop_with_a_checkpoint_too(tmp_path, recipe, config):
    out = tmp_path / "run"
    overrides = [
        f"output_dir={out}",
        "schedule.epochs=1",
        "schedule.max_steps_per_epoch=40",
        BETWEEN_SAVES,
    ]
    run = _Run(out, *overrides, recipe=recipe, config=config)
    try:
        run.wait_for_steps(2)
        run.process.send_signal(signal.SIGTERM)
        code, stdout, stderr = run.finish()
    finally:
        run.kill()
    step = _assert_stopped(code, stdout, stderr, signal.SIGTERM)
    assert _committed_steps(out) == [step] and step < 40


def test_sigterm_while_workers_start_exits_at_once_with_one_line(tmp_path):
    out = tmp_path / "run"
    run = _Run(out, *_overrides(out))
    try:
        # The workers exist but are still importing torch: the signal waits for their
        # handlers, then ends them before any training.
        deadline = time.monotonic() + 120
        while len(run.workers()) < 2:
            assert run.process.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        run.process.send_signal(signal.SIGTERM)
        code, stdout, stderr = run.finish()
    finally:
        run.kill()
    assert code == 143, stderr[-3000:]
    assert stdout == "stopped by SIGTERM before training started\n"
    assert "Traceback" not in stderr
    assert not (out / "logs" / "metrics.jsonl").exists() and not list(out.glob("step_*"))


SLOW_STOP_SAVE = """
import time
from pathlib import Path

from tunelab._paths import recipes_dir
from tunelab.checkpoint import CheckpointClient
from tunelab.config.recipe_args import LoRAFinetuneArgs

ARGS = LoRAFinetuneArgs
save = CheckpointClient.save


def slow_save(self, step, epoch, progress, *, blocking=False):
    (Path(self.output_dir) / "save_started").touch()
    time.sleep(120)
    return save(self, step, epoch, progress, blocking=blocking)


if __name__ == "__main__":
    import runpy
    CheckpointClient.save = slow_save
    runpy.run_path(str(recipes_dir() / "lora_finetune_distributed.py"), run_name="__main__")
"""


@pytest.mark.parametrize("nproc", [2, 1])
def test_a_second_sigterm_exits_at_once_without_a_checkpoint(tmp_path, nproc):
    from tunelab.lifecycle.preemption import stopping_notice

    recipe = tmp_path / "slow_stop_save.py"
    recipe.write_text(SLOW_STOP_SAVE)
    out = tmp_path / "run"
    run = _Run(out, *_overrides(out, BETWEEN_SAVES, nproc=nproc), recipe=str(recipe), nproc=nproc)
    try:
        run.wait_for_steps(3)
        run.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not (out / "save_started").exists():  # The stop's save has begun.
            assert run.process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(2.5)  # Past the window in which a repeat counts as the same signal.
        start = time.monotonic()
        run.process.send_signal(signal.SIGTERM)
        code, stdout, stderr = run.finish(timeout_s=60)
        seconds = time.monotonic() - start
    finally:
        run.kill()
    assert code == 143 and seconds < 10, (code, seconds, stderr[-3000:])
    assert stdout == "stopped by a second signal (SIGTERM): no checkpoint\n"
    assert stderr.count(stopping_notice(signal.SIGTERM)) == 1  # said at the first one
    assert "Traceback" not in stderr
    assert _committed_steps(out) == []


# --- a rank that hangs -------------------------------------------------------------------------

HANG_ON_RANK_1 = """
import os
import time
from pathlib import Path


def hang_on_rank_1(prompts, completions, rows):
    if os.environ["RANK"] == "1":
        Path(os.environ["HANG_MARKER"]).touch()
        time.sleep(600)
    return [0.0] * len(completions)
"""


def _hanging_grpo(tmp_path: Path, collective_timeout_s: int) -> _Run:
    """GRPO whose reward hangs on rank 1 in step 1: rank 0 waits in the step's next collective."""
    (tmp_path / "hang_reward.py").write_text(HANG_ON_RANK_1)
    out = tmp_path / "run"
    overrides = [
        f"output_dir={out}", "schedule.epochs=1", "schedule.max_steps_per_epoch=4", BETWEEN_SAVES,
        "rewards.functions=[{_component_: hang_reward.hang_on_rank_1}]", "rewards.weights=[1.0]",
        "rewards.timeout_s=null",  # no reward time limit: the hang lasts
        f"parallelism.collective_timeout_s={collective_timeout_s}",
    ]  # fmt: skip
    env = {"PYTHONPATH": str(tmp_path), "HANG_MARKER": str(tmp_path / "hanging")}
    return _Run(out, *overrides, recipe="grpo_distributed", config="tiny/grpo", env=env)


def _wait_for(condition, run: _Run, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert run.process.poll() is None, f"the run ended before {what}:\n{run.finish()}"
        assert time.monotonic() < deadline, f"no {what} in time:\n{run.stderr_so_far()[-3000:]}"
        time.sleep(0.05)


def test_a_collective_timeout_names_the_rank_that_did_not_arrive(tmp_path):
    # Rank 1 hangs in its reward; rank 0 times out in the step's next collective. The launcher
    # used to report rank 1, which it had SIGKILLed itself 30 s later: "recipe grpo_distributed
    # failed on rank 1 (killed by SIGKILL, signal 9 (out of memory? ...))".
    run = _hanging_grpo(tmp_path, collective_timeout_s=5)
    try:
        code, stdout, stderr = run.finish()
    finally:
        run.kill()
    errors = [line for line in stderr.splitlines() if line.startswith("tunelab: error:")]
    assert code == 1 and len(errors) == 1, stderr[-3000:]
    assert re.fullmatch(
        r"tunelab: error: rank 0: collective \w+ timed out: \w+ \([\w/]+\.py:\d+\) waited "
        r"5 s \(parallelism\.collective_timeout_s\) for rank 1, which did not arrive "
        r"\(traceback in .*rank_0\.log\)",
        errors[0],
    ), errors[0]
    assert "SIGKILL" not in stderr and "out of memory" not in stderr
    assert "Traceback" not in stderr


def test_signals_during_a_hang_say_what_they_do_and_the_second_stops_at_once(tmp_path):
    # Rank 1 hangs in its reward, rank 0 waits in a collective (for 10 minutes): neither can
    # reach a step boundary, nor run a Python signal handler (rank 0). The first signal used
    # to print nothing, and the second waited on workers that could not stop.
    from tunelab.lifecycle.preemption import stopping_notice

    run = _hanging_grpo(tmp_path, collective_timeout_s=600)
    try:
        _wait_for((tmp_path / "hanging").exists, run, "hang")
        workers = run.workers()
        run.process.send_signal(signal.SIGTERM)
        _wait_for(lambda: stopping_notice(signal.SIGTERM) in run.stderr_so_far(), run, "notice")
        time.sleep(2.5)  # Past the window in which a repeat counts as the same signal.
        start = time.monotonic()
        run.process.send_signal(signal.SIGINT)
        code = run.process.wait(60)
        seconds = time.monotonic() - start
        while any(_alive(pid) for pid in workers) and time.monotonic() - start < seconds + 5:
            time.sleep(0.05)
        left = [pid for pid in workers if _alive(pid)]
        code, stdout, stderr = run.finish()
    finally:
        run.kill()
    assert code == 130 and seconds < 10, (code, seconds, stderr[-3000:])
    assert stdout == "stopped by a second signal (SIGINT): no checkpoint\n"
    assert stderr.count(stopping_notice(signal.SIGTERM)) == 1
    assert "Traceback" not in stderr
    assert workers and not left
    assert _committed_steps(run.out) == []


# --- workers die with their launcher -----------------------------------------------------------


def _snapshot(out: Path) -> dict[str, tuple[int, int]]:
    return {
        str(path.relative_to(out)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in out.rglob("*")
        if path.is_file()
    }


@pytest.mark.parametrize("nproc", [2, 1])
def test_sigkill_of_the_launcher_ends_every_worker_and_frees_the_output_dir(tmp_path, nproc):
    out = tmp_path / "run"
    # A long run that saves every step: an orphan would keep writing.
    long_run = [
        "schedule.epochs=20",
        "schedule.max_steps_per_epoch=null",
        "checkpoint.save_every_n_steps=1",
    ]
    run = _Run(out, *_overrides(out, nproc=nproc), *long_run, nproc=nproc)
    try:
        run.wait_for_steps(3)
        workers = run.workers()
        assert len(workers) == nproc
        os.kill(run.pid, signal.SIGKILL)  # The launcher alone: the workers are not its group.
        killed = time.monotonic()
        while any(_alive(pid) for pid in workers):
            assert time.monotonic() - killed < 10, "workers outlived their launcher"
            time.sleep(0.05)
        before = _snapshot(out)
        time.sleep(3)
        assert _snapshot(out) == before  # Nothing more is written.
    finally:
        run.kill()
    # The dead run's lock does not hold up the next run into the same output_dir.
    last_step = max([0, *(int(path.name.split("_")[1]) for path in out.glob("step_*"))])
    resumed = tunelab_run(
        "lora_finetune_distributed", "tiny/lora",
        *_overrides(out, BETWEEN_SAVES, "checkpoint.resume_from_checkpoint=auto", nproc=nproc),
        f"schedule.max_steps_per_epoch={last_step + 2}", nproc=nproc,
    )  # fmt: skip
    assert f"finished at step {last_step + 2}" in resumed.stdout


# --- one run per output_dir ------------------------------------------------------------------------


def test_a_second_run_into_a_busy_output_dir_stops_at_start_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    first = _Run(
        out,
        *_overrides(out, BETWEEN_SAVES, "schedule.max_steps_per_epoch=null", "schedule.epochs=5"),
    )
    try:
        first.wait_for_steps(2)
        holder_pid = next(pid for pid in first.workers() if _rank(pid) == "0")
        steps_before = len(_logged_steps(out))
        # Through `tunelab run` (checked before torchrun starts) and through plain torchrun
        # (rank 0's own lock, every rank raises), at the same time.
        second = subprocess.Popen(
            [TUNELAB, "run", "--nproc_per_node", "2", "lora_finetune_distributed",
             "--config", "tiny/lora", *_overrides(out, BETWEEN_SAVES)],
            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        plain = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
             "--master-port", str(free_port()),
             str(recipes_dir() / "lora_finetune_distributed.py"),
             "--config", "tiny/lora", *_overrides(out, BETWEEN_SAVES)],
            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        second_out, second_err = second.communicate(timeout=300)
        _, plain_err = plain.communicate(timeout=300)
        assert first.process.poll() is None  # Still training, undisturbed.
        assert len(_logged_steps(out)) > steps_before
        first.process.send_signal(signal.SIGTERM)
        code, stdout, stderr = first.finish()
    finally:
        first.kill()
    holder = re.compile(
        rf"tunelab: error: output_dir {re.escape(str(out))} is in use by another run "
        rf"\(host [^,]+, pid {holder_pid}, started [0-9T:+-]+\): wait for it to end, or pick "
        r"another output_dir"
    )
    assert second.returncode == 1 and second_out == ""
    assert holder.fullmatch(second_err.strip()), second_err
    assert plain.returncode != 0
    # Rank 0 printed the line; torchrun's own report repeats it (and is not ours to shorten).
    assert holder.search(plain_err), plain_err[-3000:]
    assert "already holds committed checkpoints" not in plain_err
    # The first run went on to a normal stop: every step logged once, its checkpoint intact.
    step = _assert_stopped(code, stdout, stderr, signal.SIGTERM)
    assert _logged_steps(out) == list(range(1, step + 1))
    assert step in _committed_steps(out)


def _rank(pid: int) -> str | None:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((v[5:].decode() for v in environ if v.startswith(b"RANK=")), None)
