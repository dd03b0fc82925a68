"""``streaming: true`` end to end: a real 2-process ``tunelab run`` over many small JSONL shards,
interrupted mid-epoch and resumed on 2 and on 1 process."""

import json

import pytest

from tests.recipes.conftest import COMMON, interrupted_copy, losses_by_step, tunelab_run
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow

TINY = assets_dir() / "tiny"
NUM_SHARDS, ROWS_PER_SHARD = 40, 20
# Packed, a shuffle window of 50 rows (it spans shards): the step-3 checkpoint lands inside a
# window and inside a pack, so the resume must rebuild both from the saved location.
STREAM = [
    "dataset.streaming=true",
    "dataset.packed=true",
    "dataset.shuffle_buffer_size=50",
    "dataset.data_files=null",
]


@pytest.fixture(scope="module")
def stream_2p(tmp_path_factory):
    """The streamed run, uninterrupted: 2 processes of 4 packs (read-only: copy it)."""
    root = tmp_path_factory.mktemp("streaming")
    shards = root / "shards"
    shards.mkdir()
    rows = (TINY / "sft.jsonl").read_text().splitlines()
    for shard in range(NUM_SHARDS):
        lines = rows[shard * ROWS_PER_SHARD : (shard + 1) * ROWS_PER_SHARD]
        (shards / f"part-{shard:03d}.jsonl").write_text("\n".join(lines) + "\n")
    out = root / "run"
    _run(out, shards, "schedule.batch_size=4")
    return out, shards


def _run(out, shards, *extra, nproc=2):
    return tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", f"dataset.source={shards}",
        *STREAM, *COMMON, *extra, nproc=nproc,
    )  # fmt: skip


@pytest.mark.parametrize("resume_nproc", [2, 1])
def test_streamed_run_resumes_exactly(stream_2p, tmp_path, resume_nproc):
    reference, shards = stream_2p
    progress = json.loads((reference / "step_3" / "trainer_state.json").read_text())
    stream = _find(progress, "stream")
    # Mid-window, and the state is a few integers (no buffered rows, no tensors).
    assert stream["taken"] > 0 and set(stream) == {"window", "source", "row", "taken", "sample"}
    out = interrupted_copy(reference, tmp_path / "run", after_step=3)
    # batch_size is not given: the resume keeps the recorded global batch of 8 packs.
    result = _run(out, shards, "checkpoint.resume_from_checkpoint=true", nproc=resume_nproc)
    assert "resumed from step_3 (epoch 0, step 3 of 6)" in result.stdout
    resumed, expected = losses_by_step(out), losses_by_step(reference)
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        if resume_nproc == 2:
            assert resumed[step] == expected[step], step
        else:  # one process sums in another order
            assert abs(resumed[step] - expected[step]) <= 1e-5, step


def test_streaming_without_max_steps_per_epoch_is_a_clear_error(stream_2p, tmp_path):
    _, shards = stream_2p
    result = tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={tmp_path / 'run'}",
        f"dataset.source={shards}", *STREAM, "schedule.max_steps_per_epoch=null", nproc=1, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "key 'schedule.max_steps_per_epoch': dataset.streaming: true needs it" in result.stderr


def _find(record, key):
    """The first value of ``key`` anywhere in a JSON record."""
    if isinstance(record, dict):
        if key in record:
            return record[key]
        values = record.values()
    elif isinstance(record, list):
        values = record
    else:
        return None
    for value in values:
        found = _find(value, key)
        if found is not None:
            return found
    return None


def test_the_shipped_streaming_config_runs_and_resumes_exactly(tmp_path):
    """``tiny/stream_lora`` as shipped (streamed, packed, a shuffle window of 50 rows, 6 steps,
    a checkpoint every 3): killed after step 3 and resumed, its steps 4-6 are the same."""
    out = tmp_path / "run"
    tunelab_run("lora_finetune_distributed", "tiny/stream_lora", f"output_dir={out}")
    losses = losses_by_step(out)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    resumed = interrupted_copy(out, tmp_path / "resumed", after_step=3)
    tunelab_run(
        "lora_finetune_distributed", "tiny/stream_lora", f"output_dir={resumed}",
        "checkpoint.resume_from_checkpoint=true",
    )  # fmt: skip
    assert losses_by_step(resumed) == {step: losses[step] for step in (4, 5, 6)}
