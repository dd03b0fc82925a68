"""Asynchronous GRPO (rollout.mode async): real 2-process ``tunelab run``s of tiny/grpo.

k = 0 is synchronous GRPO bit for bit; with k = 2 two runs are identical, the lag follows the
fixed schedule, and a run whose rank 1 is SIGKILLed after a checkpoint resumes to the
uninterrupted run's completions, metrics and exports (the batches in flight restored).
``rollout.overlap`` (a worker thread sampling on a whole copy of the model) equals the plain
colocated run bit for bit and resumes its checkpoint exactly.
"""

import json
import shutil
from pathlib import Path

import pytest

from tests.recipes.conftest import (
    TUNELAB,
    assert_same_exports,
    read_metrics,
    tunelab_run,
)
from tests.recipes.test_grpo import assert_step_logs_equal, completions, sigkill_rank_1

pytestmark = pytest.mark.slow

# Two optimizer passes per batch (stored old log-probs) and a KL to the reference.
COMMON = ("schedule.batch_size=2", "loss.beta=0.04", "rollout.num_iterations=2")
# k = 2: at step_3's checkpoint the batches of steps 4 and 5 are in flight; dynamic sampling
# with a refill round puts refill micro-batches (which draw no loader batch) among them.
ASYNC = (
    *COMMON,
    "rollout.mode=async",
    "rollout.max_lag=2",
    "rollout.dynamic_sampling=true",
    "rollout.dynamic_sampling_refill_rounds=1",
    "schedule.max_steps_per_epoch=6",
    "checkpoint.save_every_n_steps=3",
)
TIMINGS = ("tokens_per_second", "generation_tokens_per_second", "train_tokens_per_second",
           "off_policy/sample_seconds", "peak_memory_gib")  # fmt: skip


def run(out: Path, *overrides: str) -> Path:
    tunelab_run("grpo_distributed", "tiny/grpo", f"output_dir={out}", *overrides)
    return out


def untimed(output_dir: Path) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMINGS} for m in read_metrics(output_dir)]


def test_lag_zero_is_synchronous_grpo_bit_for_bit(tmp_path):
    steps = ("schedule.max_steps_per_epoch=2", "checkpoint.save_every_n_steps=null")
    sync = run(tmp_path / "sync", *COMMON, *steps)
    lag_zero = run(tmp_path / "k0", *COMMON, *steps, "rollout.mode=async", "rollout.max_lag=0")
    assert (sync / "logs/completions.jsonl").read_bytes() == (
        lag_zero / "logs/completions.jsonl"
    ).read_bytes()
    ours, theirs = untimed(lag_zero), untimed(sync)
    assert ours == theirs  # loss, grad_norm, kl, off_policy/*: every number equal
    assert [m["off_policy/lag"] for m in ours] == [0, 0]
    # The recorded behaviour log-probs are the trainer's up to rounding: KL ~1e-13 measured.
    assert all(0 <= m["off_policy/kl"] < 1e-9 for m in ours)
    assert all(m["off_policy/clip_fraction"] == 0 for m in ours)
    assert_same_exports(lag_zero, sync)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> Path:
    return run(tmp_path_factory.mktemp("grpo_async") / "full", *ASYNC)


def test_the_lag_follows_the_schedule_and_is_corrected(async_run):
    metrics = read_metrics(async_run)
    # Batch s is sampled by the policy of step max(s - 2, 0).
    assert [m["off_policy/lag"] for m in metrics] == [0, 1, 2, 2, 2, 2]
    assert metrics[0]["off_policy/kl"] < 1e-9
    # A lagged batch: the policy moved (lr 3e-3), the trainer and behaviour log-probs differ.
    assert all(m["off_policy/kl"] > 1e-6 for m in metrics[1:])
    assert all(0 <= m["off_policy/clip_fraction"] <= 1 for m in metrics)
    assert any(key[1] > 0 for key in completions(async_run))  # refill rounds ran


def test_two_async_runs_with_one_seed_are_identical(async_run, tmp_path):
    again = run(tmp_path / "again", *ASYNC)
    assert (again / "logs/completions.jsonl").read_bytes() == (
        async_run / "logs/completions.jsonl"
    ).read_bytes()
    assert untimed(again) == untimed(async_run)
    assert_same_exports(again, async_run)


def in_flight_after_the_kill(out: Path, *, committed: int) -> list[dict]:
    """Rank 0's batches in flight in ``step_<committed>``, the only step checkpoint committed
    (the record holds one entry per rank)."""
    steps = sorted(int(p.parent.name[5:]) for p in out.glob("step_*/tunelab_manifest.json"))
    assert steps == [committed]
    state = json.loads((out / f"step_{committed}" / "trainer_state.json").read_text())
    per_rank = json.loads(state["progress"]["rollouts_in_flight"])
    assert len(per_rank) == 2
    return json.loads(per_rank[0])


def test_sigkill_after_a_checkpoint_then_resume_equals_the_uninterrupted_run(async_run, tmp_path):
    """Rank 1 SIGKILLed in step 4 (step_3 committed, steps 4 and 5 in flight); resume in place."""
    out = tmp_path / "killed"
    command = [TUNELAB, "run", "--nproc_per_node", "2", "grpo_distributed", "--config",
               "tiny/grpo", f"output_dir={out}", *ASYNC]  # fmt: skip
    assert sigkill_rank_1(command, out, at_step=4, printed=tmp_path / "killed.out") != 0
    in_flight = in_flight_after_the_kill(out, committed=3)
    assert sorted(batch["step"] for batch in in_flight) == [3, 4]  # 0-based
    run(out, *ASYNC, "checkpoint.resume_from_checkpoint=true")
    assert_step_logs_equal(out, async_run)
    after = [m for m in untimed(out) if m["step"] > 3]
    assert after == [m for m in untimed(async_run) if m["step"] > 3]
    assert_same_exports(out, async_run)


# rollout.overlap: the colocated run with a worker thread sampling on a whole copy of the model
# (k = 1: batch s + 1 sampled while step s trains); step_2 holds the batch of step 3 in flight.
COLOCATED = (
    *COMMON,
    "rollout.mode=async",
    "rollout.max_lag=1",
    "schedule.max_steps_per_epoch=4",
    "checkpoint.save_every_n_steps=2",
)


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory) -> Path:
    return run(tmp_path_factory.mktemp("grpo_colocated") / "colocated", *COLOCATED)


def test_overlap_equals_the_colocated_run_bit_for_bit(colocated_run, tmp_path):
    overlapped = run(tmp_path / "overlap", *COLOCATED, "rollout.overlap=true")
    assert (overlapped / "logs/completions.jsonl").read_bytes() == (
        colocated_run / "logs/completions.jsonl"
    ).read_bytes()
    assert untimed(overlapped) == untimed(colocated_run)
    assert [m["off_policy/lag"] for m in untimed(overlapped)] == [0, 1, 1, 1]
    assert_same_exports(overlapped, colocated_run)


def test_overlap_resumes_a_colocated_checkpoint_exactly(colocated_run, tmp_path):
    """step_2 of the colocated run (the batch of step 3 in flight), resumed with the overlap."""
    out = tmp_path / "resumed"
    shutil.copytree(colocated_run, out)
    for later in ("step_4", "epoch_0"):
        shutil.rmtree(out / later)
    run(out, *COLOCATED, "rollout.overlap=true", "checkpoint.resume_from_checkpoint=true")
    assert_step_logs_equal(out, colocated_run)
    assert untimed(out) == untimed(colocated_run)
    assert_same_exports(out, colocated_run)
