"""Two nodes on this machine: two ``tunelab run --nnodes 2 --node-rank i --nproc_per_node 1
--rdzv-backend c10d`` launchers, one worker each, sharing one output_dir.

Their losses equal those of the same run on one node with two processes (fp32, 1e-6): the
same two ranks compute the same thing wherever they run. Both
nodes write their shards of each step checkpoint and export into the one output_dir, rank 0
commits once, and the checkpoint resumes exactly on one node (the resume on two nodes is
tests/recipes/test_restarts.py, after a killed worker).
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import (
    COMMON,
    STEPS,
    Nodes,
    interrupted_copy,
    losses_by_step,
    tunelab_run,
)

pytestmark = pytest.mark.slow
TIMEOUT_S = 150
TOLERANCE = 1e-6


def _two_nodes(tmp_path, recipe, config, out, *overrides):
    nodes = Nodes(recipe, config, f"output_dir={out}", *overrides, log_dir=tmp_path)
    nodes.wait(TIMEOUT_S)
    return nodes


def _assert_losses(output_dir, reference_dir, steps):
    losses, reference = losses_by_step(output_dir), losses_by_step(reference_dir)
    assert sorted(losses) == sorted(steps), losses
    for step in steps:
        assert abs(losses[step] - reference[step]) <= TOLERANCE, (step, losses[step], reference)


def _assert_same_tensors(left, right):
    left, right = load_file(left), load_file(right)
    assert left.keys() == right.keys()
    for key in left:
        assert torch.allclose(left[key], right[key], rtol=0, atol=TOLERANCE), key


def test_lora_two_nodes_match_one_node_and_resume_on_one_node(tmp_path, lora_2p):
    out = tmp_path / "two_nodes"
    _two_nodes(
        tmp_path, "lora_finetune_distributed", "tiny/lora", out, "schedule.batch_size=8", *COMMON
    )
    _assert_losses(out, lora_2p, range(1, STEPS + 1))

    # One commit per step, of both nodes' shards.
    for step in (3, STEPS):
        manifest = json.loads((out / f"step_{step}" / "tunelab_manifest.json").read_text())
        assert manifest["world_size"] == 2
        assert {"__0_0.distcp", "__1_0.distcp"} <= set(manifest["files"])
    export = out / "epoch_0"
    assert (export / "tunelab_manifest.json").is_file()
    assert (export / "adapter" / "adapter_model.safetensors").is_file()

    # The two-node checkpoint resumes exactly on one node with two processes.
    one_node = interrupted_copy(out, tmp_path / "one_node", after_step=3)
    tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={one_node}", "schedule.batch_size=8",
        *COMMON, "checkpoint.resume_from_checkpoint=true",
    )  # fmt: skip
    _assert_losses(one_node, lora_2p, range(4, STEPS + 1))
    _assert_same_tensors(export / "model.safetensors", one_node / "epoch_0" / "model.safetensors")
    _assert_same_tensors(
        export / "adapter" / "adapter_model.safetensors",
        one_node / "epoch_0" / "adapter" / "adapter_model.safetensors",
    )


def test_full_finetune_two_nodes_match_one_node(tmp_path, full_2p):
    out = tmp_path / "two_nodes"
    _two_nodes(
        tmp_path, "full_finetune_distributed", "tiny/full", out, "schedule.batch_size=8", *COMMON
    )
    _assert_losses(out, full_2p, range(1, STEPS + 1))
    _assert_same_tensors(
        out / "epoch_0" / "model.safetensors", full_2p / "epoch_0" / "model.safetensors"
    )


def test_dpo_two_nodes_match_one_node(tmp_path, dpo_2p):
    # dpo_2p: tiny/lora_dpo on one node; its steps 1-4 are in warm-up, so a 4-step run's
    # learning rates are its own.
    out = tmp_path / "two_nodes"
    _two_nodes(
        tmp_path, "lora_dpo_distributed", "tiny/lora_dpo", out, "schedule.max_steps_per_epoch=4"
    )
    _assert_losses(out, dpo_2p[0], range(1, 5))
