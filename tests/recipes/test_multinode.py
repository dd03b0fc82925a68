"""Two nodes on this machine: two ``tunelab run --nnodes 2 --node-rank i --nproc_per_node 1
--rdzv-backend c10d`` launchers, one worker each, sharing one output_dir.

Their losses equal the single-node 2-process golden values of test_sft_recipes and
test_lora_dpo (fp32, 1e-6): the same two ranks compute the same thing wherever they run. Both
nodes write their shards of each step checkpoint and export into the one output_dir, rank 0
commits once, and the checkpoint resumes exactly on one node (the resume on two nodes is
tests/recipes/test_restarts.py, after a killed worker).
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import Nodes, interrupted_copy, losses_by_step, tunelab_run
from tests.recipes.test_lora_dpo import GOLDEN_LOSSES as DPO_GOLDEN
from tests.recipes.test_sft_recipes import COMMON, FULL_GOLDEN, LORA_GOLDEN, STEPS

pytestmark = pytest.mark.slow
TIMEOUT_S = 150
TOLERANCE = 1e-6


def _two_nodes(tmp_path, recipe, config, out, *overrides):
    nodes = Nodes(recipe, config, f"output_dir={out}", *overrides, log_dir=tmp_path)
    nodes.wait(TIMEOUT_S)
    return nodes


def _assert_losses(output_dir, golden, steps):
    losses = losses_by_step(output_dir)
    assert sorted(losses) == sorted(steps), losses
    for step in steps:
        assert abs(losses[step] - golden[step]) <= TOLERANCE, (step, losses[step], golden[step])


def _assert_same_tensors(left, right):
    left, right = load_file(left), load_file(right)
    assert left.keys() == right.keys()
    for key in left:
        assert torch.allclose(left[key], right[key], rtol=0, atol=TOLERANCE), key


def test_lora_two_nodes_match_one_node_and_resume_on_one_node(tmp_path):
    out = tmp_path / "two_nodes"
    _two_nodes(tmp_path, "lora_finetune_distributed", "tiny/lora", out, "batch_size=8", *COMMON)
    _assert_losses(out, LORA_GOLDEN, range(1, STEPS + 1))

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
        "lora_finetune_distributed", "tiny/lora", f"output_dir={one_node}", "batch_size=8",
        *COMMON, "checkpoint.resume_from_checkpoint=true",
    )  # fmt: skip
    _assert_losses(one_node, LORA_GOLDEN, range(4, STEPS + 1))
    _assert_same_tensors(export / "model.safetensors", one_node / "epoch_0" / "model.safetensors")
    _assert_same_tensors(
        export / "adapter" / "adapter_model.safetensors",
        one_node / "epoch_0" / "adapter" / "adapter_model.safetensors",
    )


def test_full_finetune_two_nodes_match_one_node(tmp_path):
    out = tmp_path / "full"
    _two_nodes(
        tmp_path, "full_finetune_distributed", "tiny/full", out, "batch_size=8", *COMMON,
        "checkpoint.save_every_n_steps=null", "run_val_every_n_steps=null",
    )  # fmt: skip
    _assert_losses(out, FULL_GOLDEN, range(1, STEPS + 1))
    assert (out / "epoch_0" / "model.safetensors").is_file()


def test_dpo_two_nodes_match_one_node(tmp_path):
    out = tmp_path / "dpo"
    # The first 5 steps are all in the warm-up, so 5 steps reproduce the 40-step golden run's.
    _two_nodes(tmp_path, "lora_dpo_distributed", "tiny/lora_dpo", out, "max_steps_per_epoch=5")
    golden = dict(enumerate(DPO_GOLDEN, start=1))
    _assert_losses(out, golden, range(1, 6))
