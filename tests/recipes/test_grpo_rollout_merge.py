"""Merged adapters in an FSDP2 rollout on 2 processes (rollout_merge_script.py)."""

import json
from pathlib import Path

import pytest

from tests.recipes.conftest import torchrun

pytestmark = pytest.mark.slow


def test_fsdp_rollouts_merge_the_gathered_weights_and_leave_the_shards_alone():
    result = torchrun(Path(__file__).parent / "rollout_merge_script.py")
    reports = [
        json.loads(line.removeprefix("MERGE "))
        for line in result.stdout.splitlines()
        if line.startswith("MERGE ")
    ]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        # Two merged calls, each merging every adapter once, from whole (gathered) weights.
        assert report["merged"] == 2 * report["lora_layers"] > 0, report
        assert report["merged_dtensors"] == 0, report
        # Every group gathered once for the call (on entry, before the first forward).
        assert report["gathers"] <= report["groups"], report
        # 8 completions of up to 12 tokens each: the same with and without merging.
        assert report["tokens"] > 8 and report["equal"], report
        assert report["untouched"] and report["sharded"] and report["no_merged_left"], report
