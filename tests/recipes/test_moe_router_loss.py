"""The router's load-balancing loss in the SFT objective, against transformers.

``router_aux_loss_coef`` set, a 1-process run of ``tiny/moe_lora`` logs ``router_aux_loss``
equal to transformers' ``aux_loss`` of the same first batch (padding masked), keeps ``loss``
the token loss, and the term reaches the gradient (another grad norm than without it).
"""

import pytest

from tests.recipes.conftest import read_metrics, tunelab_run
from tests.recipes.independent_loss import moe_step_one_router_loss, sft_step_one_loss

pytestmark = pytest.mark.slow
BATCH = 4
_RUN = (
    "~val_dataset",
    f"schedule.batch_size={BATCH}",
    "schedule.epochs=1",
    "schedule.max_steps_per_epoch=1",
    "checkpoint.save_every_n_steps=null",
    "checkpoint.export_every_n_epochs=2",
)


def _first_step(out, *overrides):
    tunelab_run(
        "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={out}", *_RUN, *overrides,
        nproc=1,
    )  # fmt: skip
    (row,) = [record for record in read_metrics(out) if "loss" in record]
    return row


def test_router_loss_equals_transformers_and_reaches_the_gradient(tmp_path):
    row = _first_step(tmp_path / "with", "router.aux_loss_coef=0.5")
    expected = moe_step_one_router_loss("tiny/moe_lora", global_batch=BATCH)
    assert abs(row["router_aux_loss"] - expected) <= 1e-5, (row, expected)
    # The logged loss stays the token loss (LoRA's B is 0 at step 1: the base's loss).
    assert abs(row["loss"] - sft_step_one_loss("tiny/moe_lora", global_batch=BATCH)) <= 1e-5
    # tiny_moe's config.json says output_router_logits: false, so null (the default) adds none.
    without = _first_step(tmp_path / "without")
    assert "router_aux_loss" not in without
    assert without["loss"] == row["loss"] and without["grad_norm"] != row["grad_norm"]
