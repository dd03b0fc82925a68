"""GSPO through the real 2-process grpo_distributed: a new policy loss is a config line.

``loss._component_=tunelab.rl.GSPOLoss`` is the only change to tiny/grpo (``~loss.aggregation``
drops the one GRPOLoss argument GSPOLoss does not take); the recipe is not touched. With two
iterations per batch of rollouts the second pass runs with the policy the first one moved, so
the sequence ratios leave 1 and GSPO's narrow clip range (3e-4 / 4e-4) acts.
"""

import math

import pytest
from safetensors.torch import load_file

from tests.recipes.conftest import read_metrics, tunelab_run

pytestmark = pytest.mark.slow


def test_gspo_trains_through_the_recipe_from_one_config_line(tmp_path):
    out = tmp_path / "gspo"
    tunelab_run(
        "grpo_distributed", "tiny/grpo", f"output_dir={out}",
        "loss._component_=tunelab.rl.GSPOLoss", "~loss.aggregation",
        "schedule.batch_size=2", "rollout.num_iterations=2", "schedule.max_steps_per_epoch=2",
        "checkpoint.save_every_n_steps=null",
    )  # fmt: skip
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    # The second pass's sequence ratios moved off 1: GSPO clipped whole completions (the
    # clip fraction counts their tokens).
    assert max(m["clip_fraction"] for m in metrics) > 0
    # The adapter trained: its B matrices (zero at the start) are not zero in the export.
    weights = load_file(out / "epoch_0" / "adapter" / "adapter_model.safetensors")
    lora_b = [value for key, value in weights.items() if "lora_B" in key]
    assert lora_b and all(value.abs().max() > 0 for value in lora_b)
