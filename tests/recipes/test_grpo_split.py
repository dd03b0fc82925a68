"""Asynchronous GRPO on split ranks (rollout.ranks): real ``tunelab run``s of tiny/grpo.

3 processes, the last a rollout rank serving 2 FSDP trainers, k = 1: the run equals the
colocated async run on 2 processes bit for bit (completions, every untimed metric, exports),
logs the lag histogram and the transfer metrics; a rollout rank SIGKILLed mid-transfer (its
receive of the first request after step_3's checkpoint, after the length arrived) ends the run
with one line naming it, and the resume equals the uninterrupted run; a stalled one (it sleeps
there) ends a 2-process run after the timeout with one line naming it.
"""

import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.recipes.conftest import (
    RECIPE_TIMEOUT_S,
    TUNELAB,
    assert_same_exports,
    read_metrics,
    run_env,
    tunelab_run,
)
from tests.recipes.test_grpo import assert_step_logs_equal
from tests.recipes.test_grpo_async import TIMINGS
from tunelab import _paths

pytestmark = pytest.mark.slow

ASYNC = (
    "rollout.mode=async",
    "rollout.max_lag=1",
    "schedule.max_steps_per_epoch=6",
    "checkpoint.save_every_n_steps=3",
)
SPLIT = (*ASYNC, "rollout.ranks=1")

# The real recipe, with rank FAULT_RANK dying (kill) or sleeping (stall) in its
# FAULT_AT_RECEIVE-th receive of a request, after the message's length arrived.
FAULTY_RECIPE = """
import os
import runpy
import signal
import time

from tunelab.config import GRPOArgs
from tunelab.rl import weight_sync

ARGS = GRPOArgs
receive_weights, wait = weight_sync.receive_weights, weight_sync._wait
calls = []


def failing_wait(*args, **kwargs):
    wait(*args, **kwargs)
    if os.environ["FAULT"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)


def counting_receive(*args, **kwargs):
    calls.append(1)
    if len(calls) == int(os.environ["FAULT_AT_RECEIVE"]):
        weight_sync._wait = failing_wait
    return receive_weights(*args, **kwargs)


if __name__ == "__main__":
    if os.environ["RANK"] == os.environ["FAULT_RANK"]:
        weight_sync.receive_weights = counting_receive
    runpy.run_path(os.environ["REAL_RECIPE"], run_name="__main__")
"""


def run(out: Path, *overrides: str, nproc: int = 3) -> Path:
    tunelab_run("grpo_distributed", "tiny/grpo", f"output_dir={out}", *overrides, nproc=nproc)
    return out


def untimed(output_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in m.items() if k not in TIMINGS and not k.startswith("async/")}
        for m in read_metrics(output_dir)
    ]


def faulty_run(tmp_path: Path, name: str, nproc: int, *overrides: str, **env: str):
    recipe = tmp_path / "faulty.py"
    recipe.write_text(FAULTY_RECIPE)
    out = tmp_path / name
    real = _paths.recipes_dir() / "grpo_distributed.py"
    result = subprocess.run(
        [TUNELAB, "run", "--nproc_per_node", str(nproc), str(recipe), "--config", "tiny/grpo",
         f"output_dir={out}", *overrides],
        capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S,
        env=run_env(REAL_RECIPE=str(real), **env),
    )  # fmt: skip
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("tunelab: error:")]
    return out, result, errors, output


@pytest.fixture(scope="module")
def split_run(tmp_path_factory) -> Path:
    return run(tmp_path_factory.mktemp("grpo_split") / "split", *SPLIT)


def test_a_split_run_equals_the_colocated_run_with_as_many_trainers(split_run, tmp_path):
    colocated = run(tmp_path / "colocated", *ASYNC, nproc=2)
    assert (split_run / "logs/completions.jsonl").read_bytes() == (
        colocated / "logs/completions.jsonl"
    ).read_bytes()
    assert untimed(split_run) == untimed(colocated)
    assert_same_exports(split_run, colocated)


def test_the_split_run_logs_lags_idle_times_and_transfers(split_run):
    metrics = read_metrics(split_run)
    assert [m["off_policy/lag"] for m in metrics] == [0, 1, 1, 1, 1, 1]
    assert [
        (m["off_policy/lag_histogram/0"], m["off_policy/lag_histogram/1"]) for m in metrics
    ] == [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5)]
    assert metrics[0]["off_policy/kl"] < 1e-9  # lag 0: the recorded log-probs are the trainer's
    assert all(m["off_policy/kl"] > 1e-6 for m in metrics[1:])
    assert all(0 <= m["off_policy/clip_fraction"] <= 1 for m in metrics)
    # The adapter alone goes to the rollout rank, once per policy (steps 1-5 ask with a new
    # one; the last asks for nothing): the exported adapter's bytes.
    adapter = load_file(next(split_run.glob("epoch_*/adapter/adapter_model.safetensors")))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    sent = [m["async/weight_transfer_bytes"] for m in metrics]
    assert sent == [adapter_bytes] * 5 + [0]
    assert all(m["async/weight_transfer_seconds"] >= 0 for m in metrics)
    assert all(m["async/trainer_idle_seconds"] > 0 for m in metrics)
    assert all(m["async/rollout_idle_seconds"] >= 0 for m in metrics)


def test_a_rollout_rank_killed_mid_transfer_is_named_and_the_resume_is_exact(split_run, tmp_path):
    # Its 9th receive: 2 trainers x 4 requests (steps 0-3) before it; the 5th asks, after
    # step_3's checkpoint, for step 4's batch with step 3's policy (the adapter with it).
    out, result, errors, output = faulty_run(
        tmp_path, "killed", 3, *SPLIT, FAULT="kill", FAULT_RANK="2", FAULT_AT_RECEIVE="9"
    )
    assert result.returncode != 0, output
    assert len(errors) == 1 and "rank 2" in errors[0], output
    assert "Traceback" not in output, output
    committed = sorted(int(p.parent.name[5:]) for p in out.glob("step_*/tunelab_manifest.json"))
    assert committed == [3]
    run(out, *SPLIT, "checkpoint.resume_from_checkpoint=true")
    assert_step_logs_equal(out, split_run)
    assert untimed(out) == untimed(split_run)
    assert_same_exports(out, split_run)


def test_a_stalled_rollout_rank_ends_the_run_after_the_timeout_naming_it(tmp_path):
    out, result, errors, output = faulty_run(
        tmp_path, "stalled", 2, *SPLIT, "parallelism.collective_timeout_s=10",
        FAULT="stall", FAULT_RANK="1", FAULT_AT_RECEIVE="3",
    )  # fmt: skip
    assert result.returncode != 0, output
    assert len(errors) == 1, output
    assert "rollout rank 1" in errors[0] and "10 s" in errors[0], output
