"""``profile: true`` in a real 2-process run: one readable Chrome trace per rank."""

import json

import pytest

from tests.recipes.conftest import losses_by_step, tunelab_run

pytestmark = pytest.mark.slow


def test_profile_writes_one_trace_per_rank_and_says_where(tmp_path):
    out = tmp_path / "run"
    result = tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", "schedule.epochs=1",
        "schedule.max_steps_per_epoch=4", "profile=true", "profile.skip_first=1",
        "profile.record_steps=2",
    )  # fmt: skip
    assert sorted(losses_by_step(out)) == [1, 2, 3, 4]
    for rank in (0, 1):
        trace = json.loads((out / "profile" / f"rank_{rank}.json").read_text())
        names = {event.get("name", "") for event in trace["traceEvents"]}
        assert any(name.startswith("ProfilerStep#") for name in names), rank
        assert any(name.startswith("aten::") for name in names), rank
    assert str(out / "profile") in result.stdout + result.stderr
