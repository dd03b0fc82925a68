"""KTO (kto_distributed, tiny/kto) and ORPO (lora_dpo_distributed, tiny/orpo), real runs.

For each loss one 2-process run of STEPS steps with a committed checkpoint at SAVE_AT, shared
by the tests: a 1-process run with twice the accumulation (the same global batch) gives the
same losses, metrics and exports, and a resume from the SAVE_AT checkpoint gives the
uninterrupted run's losses and exports bit for bit.
"""

from pathlib import Path

import pytest

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    read_metrics,
    shared_run,
    tunelab_run,
)
from tunelab._paths import assets_dir

STEPS = 6
SAVE_AT = 3
COMMON = (
    f"schedule.max_steps_per_epoch={STEPS}",
    f"checkpoint.save_every_n_steps={SAVE_AT}",
    "checkpoint.keep_last_n_checkpoints=null",
)
RUNS = {"kto": ("kto_distributed", "tiny/kto"), "orpo": ("lora_dpo_distributed", "tiny/orpo")}
# fp32 on 1 and 2 processes sums in another order (the clipping norm of shards, the prompts'
# packing); the rounding is relative to a value's size, and AdamW at the config's lr 3e-3 carries
# it into the next steps: 2e-5 absolute for values of order 1 (loss, kl, margins), 2e-5 of the
# value above (grad norms of 4-10, summed log-probs of 15-25). Measured largest: the grad norm
# of ORPO's step 6, 9.7618, 3.05e-5 apart (3e-6 of it).
ACROSS_WORLD_SIZES = 2e-5


def _rows(output_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in read_metrics(output_dir) if "loss" in row}


@pytest.fixture(scope="module", params=sorted(RUNS))
def runs(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """``(loss, 2-process run, 1-process run with gradient_accumulation_steps 2)``."""
    recipe, config = RUNS[request.param]
    two = shared_run(tmp_path_factory, f"{request.param}_2p", recipe, config, *COMMON)
    one = shared_run(
        tmp_path_factory, f"{request.param}_1p", recipe, config, *COMMON,
        "schedule.gradient_accumulation_steps=2", nproc=1,
    )  # fmt: skip
    return request.param, two, one


@pytest.mark.slow
def test_two_processes_equal_one_with_twice_the_accumulation(runs):
    loss, two, one = runs
    rows_two, rows_one = _rows(two), _rows(one)
    assert sorted(rows_two) == sorted(rows_one) == list(range(1, STEPS + 1))
    compared = ["loss", "rewards/margins", "logps/chosen", "grad_norm"]
    compared += ["kl"] if loss == "kto" else ["rewards/accuracies"]
    for step in rows_two:
        for name in compared:
            assert rows_one[step][name] == pytest.approx(
                rows_two[step][name], abs=ACROSS_WORLD_SIZES, rel=ACROSS_WORLD_SIZES
            ), (loss, step, name)
    # The run moved (a comparison of constants would prove nothing), the KL estimate too.
    assert abs(rows_two[STEPS]["loss"] - rows_two[1]["loss"]) > 1e-3
    if loss == "kto":
        # Step 1: the policy is the reference (LoRA B = 0): z0 = 0, every loss 1 - sigmoid(0).
        assert rows_two[1]["loss"] == 0.5 and rows_two[1]["kl"] == 0.0
        assert any(rows_two[step]["kl"] > 0 for step in rows_two)
    assert_same_exports(one, two, atol=ACROSS_WORLD_SIZES)


@pytest.mark.slow
def test_kill_and_resume_is_exact(runs, tmp_path):
    loss, two, _ = runs
    recipe, config = RUNS[loss]
    resumed_dir = interrupted_copy(two, tmp_path / "resumed", after_step=SAVE_AT)
    tunelab_run(
        recipe, config, f"output_dir={resumed_dir}", *COMMON,
        "checkpoint.resume_from_checkpoint=true",
    )  # fmt: skip
    expected, resumed = _rows(two), _rows(resumed_dir)
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for step, row in resumed.items():
        for name in ("loss", "rewards/margins", "grad_norm", *(["kl"] if loss == "kto" else [])):
            assert row[name] == expected[step][name], (loss, step, name)
    assert_same_exports(resumed_dir, two)


@pytest.mark.slow
def test_kto_precomputed_reference_and_validation(tmp_path_factory, tmp_path):
    # The mismatched pairs are fixed by dataset index, so DPO's PrecomputedReference serves KTO
    # unchanged: the same losses and z0 as the live reference. The validation (evaluate_kto)
    # runs on the same rows, its z0 over all of them.
    two = shared_run(tmp_path_factory, "kto_2p", *RUNS["kto"], *COMMON)  # the runs fixture's
    val = tmp_path / "val.jsonl"
    val.write_text("".join((assets_dir() / "tiny" / "kto.jsonl").open().readlines()[:16]))
    out = tmp_path / "precomputed"
    result = tunelab_run(
        *RUNS["kto"], f"output_dir={out}", "schedule.max_steps_per_epoch=3",
        "checkpoint.save_every_n_steps=null", "reference_logps=precompute",
        "val_dataset._component_=tunelab.data.kto_dataset", "val_dataset.source=json",
        f"val_dataset.data_files={val}", "val_dataset.template=instruct",
        "schedule.run_val_every_n_steps=3",
    )  # fmt: skip
    # KTO's items are labelled rows, not pairs (its 400 rows, each with a mismatched partner).
    assert "reference log-probs of 400 rows precomputed" in result.stdout, result.stdout[-2000:]
    live, precomputed = _rows(two), _rows(out)
    for step in (1, 2, 3):  # the warm-up steps: the same learning rates as the 6-step run
        for name in ("loss", "kl", "rewards/margins"):
            assert precomputed[step][name] == pytest.approx(live[step][name], abs=1e-6), step
    (validation,) = [row for row in read_metrics(out) if "val_loss" in row]
    assert validation["step"] == 3 and validation["val_kl"] >= 0.0
    assert 0.0 < validation["val_loss"] < 1.0 and "val_rewards/margins" in validation
