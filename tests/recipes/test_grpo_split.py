"""Asynchronous GRPO on split ranks (rollout.ranks): real ``tunelab run``s of tiny/grpo.

3 processes, the last a rollout rank serving 2 FSDP trainers, k = 1: the run equals the
colocated async run on 2 processes bit for bit (completions, every untimed metric, exports),
with LoRA and with full fine-tuning (each trainer sends its own shards, sent in the
background after each update; the rollout rank assembles them), with refill rounds on 2
rollout ranks (4 processes), and logs the lag histogram and the transfer metrics. A colocated checkpoint resumes on split ranks, a split one (stopped
by a SIGTERM to the job: every rank ends, the trainers with a committed checkpoint) resumes
colocated, both exactly; another number of trainers is refused in one line. A rollout rank
SIGKILLed mid-transfer (its receive of the policy sent after step 3's update, after the length
arrived) ends the run with one line naming it, and the resume equals the uninterrupted run; a
stalled one (it sleeps there) ends a 2-process run after the timeout with one line naming it.
"""

import signal
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.recipes.conftest import (
    RECIPE_TIMEOUT_S,
    TUNELAB,
    assert_same_exports,
    interrupted_copy,
    read_metrics,
    run_env,
    tunelab_run,
)
from tests.recipes.test_grpo import assert_step_logs_equal, completions
from tests.recipes.test_grpo_async import TIMINGS
from tests.recipes.test_lifecycle_runs import _assert_stopped, _committed_steps, _Run
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
    # Hung for good, as a rank stuck outside Python: torchrun's SIGTERM ends it (a rollout
    # rank otherwise defers a stop signal to its trainers' stop).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
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


def assert_same_run(ours: Path, theirs: Path) -> None:
    assert (ours / "logs/completions.jsonl").read_bytes() == (
        theirs / "logs/completions.jsonl"
    ).read_bytes()
    assert untimed(ours) == untimed(theirs)
    assert_same_exports(ours, theirs)


def test_a_split_run_equals_the_colocated_run_with_as_many_trainers(split_run, tmp_path):
    colocated = run(tmp_path / "colocated", *ASYNC, nproc=2)
    assert_same_run(split_run, colocated)
    # The colocated run's step_3, resumed on split ranks (3 processes), ends as the split run.
    resumed = interrupted_copy(colocated, tmp_path / "resumed_split", after_step=3, keep_logs=True)
    run(resumed, *SPLIT, "checkpoint.resume_from_checkpoint=true")
    assert_same_run(resumed, split_run)  # steps 1-3 logged once by the colocated run


def test_a_split_full_fine_tune_equals_the_colocated_one(tmp_path):
    # Every weight trains: each trainer sends the rollout rank its own FSDP shards of every
    # weight, which it assembles; no trainer gathers them.
    full = (*ASYNC[:2], "lora=null", "optimizer.lr=1e-4", "schedule.max_steps_per_epoch=3",
            "checkpoint.save_every_n_steps=null")  # fmt: skip
    split = run(tmp_path / "split", *full, "rollout.ranks=1")
    colocated = run(tmp_path / "colocated", *full, nproc=2)
    assert_same_run(split, colocated)
    model = load_file(next(split.glob("epoch_*/model*.safetensors")))
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    # Policies 0 and 1 in step 1 (the first with the first request, the next right after the
    # update, for batch 2); the later ones would sample nothing.
    sent = [m["async/weight_transfer_bytes"] for m in read_metrics(split)]
    assert sent == [2 * model_bytes, 0, 0]


def test_refill_rounds_on_two_rollout_ranks_equal_the_colocated_ones(tmp_path):
    # 2 trainers + 2 rollout ranks (each serving one trainer, agreeing on the refills over
    # their own group; each trainer sending its shards to both) = colocated on 2 processes.
    refill = (*ASYNC[:2], "rollout.dynamic_sampling=true",
              "rollout.dynamic_sampling_refill_rounds=2", "schedule.max_steps_per_epoch=3",
              "checkpoint.save_every_n_steps=null")  # fmt: skip
    split = run(tmp_path / "split", *refill, "rollout.ranks=2", nproc=4)
    colocated = run(tmp_path / "colocated", *refill, nproc=2)
    assert_same_run(split, colocated)
    assert any(key[1] > 0 for key in completions(split))  # refill rounds ran


def test_the_split_run_logs_lags_idle_times_and_transfers(split_run):
    metrics = read_metrics(split_run)
    assert [m["off_policy/lag"] for m in metrics] == [0, 1, 1, 1, 1, 1]
    assert [
        (m["off_policy/lag_histogram/0"], m["off_policy/lag_histogram/1"]) for m in metrics
    ] == [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5)]
    assert metrics[0]["off_policy/kl"] < 1e-9  # lag 0: the recorded log-probs are the trainer's
    assert all(m["off_policy/kl"] > 1e-6 for m in metrics[1:])
    assert all(0 <= m["off_policy/clip_fraction"] <= 1 for m in metrics)
    # The adapter alone goes to the rollout rank, once per policy that samples: policies 0
    # (with the first request) and 1 (right after the first update) in step 1, then one
    # after each update up to step 4's (policy 5 and 6 sample nothing): the adapter's bytes.
    adapter = load_file(next(split_run.glob("epoch_*/adapter/adapter_model.safetensors")))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    sent = [m["async/weight_transfer_bytes"] for m in metrics]
    assert sent == [2 * adapter_bytes] + [adapter_bytes] * 3 + [0, 0]
    assert all(m["async/weight_transfer_seconds"] >= 0 for m in metrics)
    assert all(m["async/weight_send_blocked_seconds"] >= 0 for m in metrics)
    assert all(m["async/trainer_idle_seconds"] > 0 for m in metrics)
    assert all(m["async/rollout_idle_seconds"] >= 0 for m in metrics)


def test_a_rollout_rank_killed_mid_transfer_is_named_and_the_resume_is_exact(split_run, tmp_path):
    # Its 17th receive: requests come in rounds of 2 (one per trainer), and a new policy as
    # one piece from each trainer: rounds 1-4 (steps 0-3's batches) took 8 requests and
    # policies 0, 1, 2 (6 pieces); round 5 (after step_3's checkpoint: step 4's batch with
    # policy 3) 2 more; the 17th is trainer 0's piece of policy 3, sent in the background.
    out, result, errors, output = faulty_run(
        tmp_path, "killed", 3, *SPLIT, FAULT="kill", FAULT_RANK="2", FAULT_AT_RECEIVE="17"
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
    # Its 5th receive (one trainer): request 0, policy 0, request 1, request 2, then policy 1,
    # which the trainer sends in the background: the trainer's wait for it ends the run.
    out, result, errors, output = faulty_run(
        tmp_path, "stalled", 2, *SPLIT, "parallelism.collective_timeout_s=10",
        FAULT="stall", FAULT_RANK="1", FAULT_AT_RECEIVE="5",
    )  # fmt: skip
    assert result.returncode != 0, output
    assert len(errors) == 1, output
    assert "rollout rank 1" in errors[0] and "10 s" in errors[0], output


def test_sigterm_ends_every_rank_and_the_split_checkpoint_resumes_colocated(split_run, tmp_path):
    out = tmp_path / "stopped"
    job = _Run(out, f"output_dir={out}", *SPLIT, nproc=3, recipe="grpo_distributed",
               config="tiny/grpo")  # fmt: skip
    try:
        job.wait_for_steps(1)
        job.process.send_signal(signal.SIGTERM)  # the launcher: torchrun forwards it
        code, stdout, stderr = job.finish()
    finally:
        job.kill()
    step = _assert_stopped(code, stdout, stderr, signal.SIGTERM)
    assert 1 <= step < 6 and max(_committed_steps(out)) == step
    assert not job.workers()  # the rollout rank ended too
    # Resumed on another number of trainers: refused in one line, nothing written.
    refused = tunelab_run("grpo_distributed", "tiny/grpo", f"output_dir={out}", *SPLIT,
                          "checkpoint.resume_from_checkpoint=true", nproc=2, check=False)  # fmt: skip
    errors = [line for line in refused.stderr.splitlines() if line.startswith("tunelab: error:")]
    assert refused.returncode != 0 and len(errors) == 1, refused.stderr[-3000:]
    assert "saved by 2 training processes and this run has 1" in errors[0], errors
    assert "rollout.ranks" in errors[0] and "Traceback" not in refused.stderr
    # Resumed colocated on the 2 trainers' processes: the split run's completions and exports.
    run(out, *ASYNC, "checkpoint.resume_from_checkpoint=true", nproc=2)
    assert_same_run(out, split_run)
