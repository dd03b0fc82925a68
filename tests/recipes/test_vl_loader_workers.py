"""``schedule.dataloader_workers`` in a real ``tunelab run`` on image rows (``tiny/vl_lora``).

Two processes, each with 2 loader workers reading and preprocessing the images, train the
same losses as with none, bit for bit; a run killed after step 2's checkpoint without workers
resumes with 2 workers to the same losses and export.
"""

import pytest

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    losses_by_step,
    tunelab_run,
)

pytestmark = pytest.mark.slow
STEPS = 4
SETTINGS = [
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "schedule.batch_size=2",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=2",
    "checkpoint.keep_last_n_checkpoints=null",
]


def _run(out, workers, *extra):
    return tunelab_run(
        "lora_finetune_distributed", "tiny/vl_lora", f"output_dir={out}", *SETTINGS,
        f"schedule.dataloader_workers={workers}", *extra, nproc=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def without_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("vl_workers") / "none"
    _run(out, 0)
    return out


def test_two_workers_train_the_same_losses(without_workers, tmp_path):
    _run(tmp_path / "two", 2)
    ours, theirs = losses_by_step(tmp_path / "two"), losses_by_step(without_workers)
    assert sorted(ours) == list(range(1, STEPS + 1))
    assert ours == theirs
    assert_same_exports(tmp_path / "two", without_workers)


def test_a_resume_with_two_workers_is_exact(without_workers, tmp_path):
    out = interrupted_copy(without_workers, tmp_path / "run", after_step=2)
    _run(out, 2, "checkpoint.resume_from_checkpoint=true")
    resumed, reference = losses_by_step(out), losses_by_step(without_workers)
    assert sorted(resumed) == [3, 4]
    assert all(resumed[step] == reference[step] for step in (3, 4)), (resumed, reference)
    assert_same_exports(out, without_workers)
