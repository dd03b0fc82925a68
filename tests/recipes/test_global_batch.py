"""Exact on any world size means the same training: a resume keeps the global batch.

``batch_size`` is per process. A checkpoint records the global batch (samples per optimizer
step over all ranks); resumed on another number of processes with the same settings, the run
picks the per-process batch and accumulation that keep it, says so in one line, and trains
exactly as the uninterrupted run (same steps, losses and validation).
"""

import pytest

from tests.recipes.conftest import (
    COMMON,
    interrupted_copy,
    losses_by_step,
    read_metrics,
    tunelab_run,
)

pytestmark = pytest.mark.slow
RESUME = "checkpoint.resume_from_checkpoint=true"


def _val_losses(out):
    return {r["step"]: r["val_loss"] for r in read_metrics(out) if "val_loss" in r}


def _assert_same_run(resumed, reference, tol):
    losses, expected = losses_by_step(resumed), losses_by_step(reference)
    assert sorted(losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert abs(losses[step] - expected[step]) <= tol, (step, losses[step], expected[step])
    val, expected_val = _val_losses(resumed), _val_losses(reference)
    assert abs(val[6] - expected_val[6]) <= tol, (val[6], expected_val[6])


def test_a_2_process_checkpoint_resumed_on_1_keeps_the_global_batch(lora_2p, tmp_path):
    out = interrupted_copy(lora_2p, tmp_path / "run", after_step=3)
    # The same settings as the 2-process run (batch_size=8 per process): on 1 process that
    # would be 8 samples per step instead of 16.
    result = tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", "schedule.batch_size=8", *COMMON,
        RESUME, nproc=1,
    )  # fmt: skip
    assert (
        "keeping step_3's global batch of 16 on 1 process(es): batch_size 8, "
        "gradient_accumulation_steps 2" in result.stdout
    )
    assert "finished at step 6" in result.stdout
    _assert_same_run(out, lora_2p, 1e-5)


def test_a_1_process_checkpoint_resumed_on_2_keeps_the_global_batch(lora_1p, lora_2p, tmp_path):
    # lora_1p: 1 process of batch_size=16.
    out = interrupted_copy(lora_1p, tmp_path / "run", after_step=3)
    # batch_size=16 per process on 2 processes would be 32 samples per step.
    result = tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", "schedule.batch_size=16", *COMMON,
        RESUME,
    )  # fmt: skip
    assert "global batch of 16 on 2 process(es): batch_size 8, gradient_accumulation_steps 1" in (
        result.stdout
    )
    # The 2-process run of batch 8 is the same training as the 1-process run of batch 16.
    _assert_same_run(out, lora_2p, 1e-5)


def test_a_global_batch_that_cannot_be_kept_is_one_clear_error(lora_2p, tmp_path):
    out = interrupted_copy(lora_2p, tmp_path / "run", after_step=3)
    result = tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", "schedule.batch_size=8", *COMMON,
        RESUME, nproc=3, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    line = [line for line in result.stderr.splitlines() if line.startswith("tunelab: error")]
    assert line and "global batch of 16 samples per step, which 3 processes cannot split" in line[0]
    assert "allow_global_batch_change=true" in line[0]
    # Allowed explicitly, the run goes on with the configured batch, 24 samples per step (on
    # 1 process of 24, cheaper than 3 of 8 here): the 48 samples of steps 1-3 are 2 such
    # steps, so the epoch goes on at its step 3 of 6 and the run ends at global step 3 + 4.
    allowed = tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", "schedule.batch_size=24", *COMMON,
        RESUME, "schedule.allow_global_batch_change=true", nproc=1,
    )  # fmt: skip
    assert "keeping" not in allowed.stdout and "finished at step 7" in allowed.stdout
    assert losses_by_step(out)[4] != losses_by_step(lora_2p)[4]  # another batch: another run


def test_a_2_process_checkpoint_resumed_on_4_with_hsdp_keeps_the_global_batch(lora_2p, tmp_path):
    out = interrupted_copy(lora_2p, tmp_path / "run", after_step=3)
    # 2 replicas x 2 shards; batch_size=8 per process would be 32 samples per step on 4.
    result = tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", "schedule.batch_size=8", *COMMON,
        RESUME, "parallelism.data_parallel_replicate_size=2", "parallelism.data_parallel_shard_size=2", nproc=4,
    )  # fmt: skip
    assert "global batch of 16 on 4 process(es): batch_size 4, gradient_accumulation_steps 1" in (
        result.stdout
    )
    _assert_same_run(out, lora_2p, 1e-5)
