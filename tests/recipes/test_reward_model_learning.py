"""tiny/reward_model learns: held-out accuracy above 0.8, and not without learning.

The run is the config as shipped (2 processes, 12 epochs of 8 pairs a step); the control is the
same run with a learning rate of 1e-12 (AdamW refuses 0), cut to its first two steps, whose
validation is the fresh head's. The held-out pairs are new prompts of the reversal, sort and
count tasks (docs/recipes.md says why no next-number pairs). Measured with seeds 0-3 on 2
processes: 0.833, 0.865, 0.812, 0.854; the control 0.51. (8 epochs gave 0.79-0.865 after the
shared-prompt forward changed the rounding: too close to the line.)
"""

import pytest

from tests.recipes.conftest import read_metrics, shared_run

pytestmark = pytest.mark.slow


def final_validation(output_dir) -> dict:
    return [row for row in read_metrics(output_dir) if "val_accuracy" in row][-1]


def test_validation_accuracy_rises_and_lr_near_zero_stays_at_chance(tmp_path_factory):
    trained = shared_run(
        tmp_path_factory, "reward_model_learning", "reward_model_distributed", "tiny/reward_model",
        "checkpoint.save_every_n_steps=1000",
    )  # fmt: skip
    control = shared_run(
        tmp_path_factory, "reward_model_lr0", "reward_model_distributed", "tiny/reward_model",
        "optimizer.lr=1e-12", "schedule.epochs=1", "schedule.max_steps_per_epoch=2",
        "checkpoint.save_every_n_steps=1000",
    )  # fmt: skip
    learned, chance = final_validation(trained), final_validation(control)
    print(f"trained {learned}\ncontrol {chance}")  # shown with -s: the figures docs quote
    assert learned["val_accuracy"] > 0.8, learned
    assert learned["val_margin"] > 0.2, learned
    assert 0.35 <= chance["val_accuracy"] <= 0.65, chance
    assert abs(chance["val_margin"]) < 0.1, chance
