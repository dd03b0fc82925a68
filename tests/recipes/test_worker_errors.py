"""What a user sees when a worker fails: one line from the launcher, the traceback in a file."""

import math
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import TUNELAB, losses_by_step, read_metrics, run_env, tunelab_run

pytestmark = pytest.mark.slow

# A copied recipe whose step fails on one rank with an error that is not tunelab's own.
FAILING_RECIPE = """
import os

from tunelab.lifecycle import recipe_main
from tunelab.config.recipe_args import LoRAFinetuneArgs
from tunelab.distributed import init_distributed

ARGS = LoRAFinetuneArgs


def main(args):
    init_distributed(args.device)
    if os.environ["RANK"] == os.environ["FAILING_RANK"]:
        raise ValueError("boom in the loss\\nsecond line of the message")
    import torch.distributed as dist

    dist.barrier()  # the other rank waits here until torchrun stops it


if __name__ == "__main__":
    recipe_main(main, ARGS)
"""


@pytest.mark.parametrize("nproc, failing_rank", [(2, 1), (1, 0)])
def test_worker_error_is_one_line_and_the_traceback_goes_to_the_rank_log(
    tmp_path, nproc, failing_rank
):
    recipe = tmp_path / "failing.py"
    recipe.write_text(FAILING_RECIPE)
    out = tmp_path / "run"
    launcher = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    result = subprocess.run(
        [TUNELAB, "run", *launcher, str(recipe), "--config", "tiny/lora", f"output_dir={out}"],
        capture_output=True, text=True, timeout=300,
        env=run_env(FAILING_RANK=str(failing_rank)),
    )  # fmt: skip
    output = result.stdout + result.stderr
    log = out / "logs" / f"rank_{failing_rank}.log"
    assert result.returncode == 1, output
    assert "Traceback" not in output and "<NONE>" not in output, output
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert errors == [
        f"tunelab: error: rank {failing_rank}: ValueError: boom in the loss (traceback in {log})"
    ], output
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "second line of the message" in text
    # --debug shows the traceback on the terminal as well.
    debug = subprocess.run(
        [TUNELAB, "run", *launcher, str(recipe), "--config", "tiny/lora", f"output_dir={out}",
         "--debug"],
        capture_output=True, text=True, timeout=300,
        env=run_env(FAILING_RANK=str(failing_rank)),
    )  # fmt: skip
    assert debug.returncode == 1 and "Traceback" in debug.stdout + debug.stderr


def test_a_diverging_run_stops_at_the_first_non_finite_step_with_one_line(tmp_path):
    out = tmp_path / "run"
    # An update of 1e30 per weight overflows fp32 activations on any IEEE machine. (With 1e6 an
    # AMD EPYC's kernels overflowed at step 3, a Sapphire Rapids' saturated the logits into a
    # finite uniform distribution, loss ln(vocab), and the run never went non-finite.)
    diverge = [
        "optimizer.lr=1e30",
        "schedule.clip_grad_norm=null",
        "schedule.epochs=1",
        "schedule.max_steps_per_epoch=6",
    ]
    result = tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", *diverge, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output
    errors = [line for line in output.splitlines() if line.startswith("tunelab: error:")]
    assert len(errors) == 1 and "is not finite: stopping before it changes the weights" in errors[0]
    step = int(errors[0].split("step ")[1].split(":")[0])
    assert all(math.isfinite(loss) for s, loss in losses_by_step(out).items() if s < step)
    assert not (out / "epoch_0").exists()
    # With a budget, the non-finite steps are skipped (no update) and the run finishes with
    # finite weights.
    skipping = tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={tmp_path / 'skip'}", *diverge,
        "schedule.skip_nonfinite_steps=6",
    )  # fmt: skip
    assert "skipped (1 of 6 allowed)" in skipping.stderr
    records = read_metrics(tmp_path / "skip")
    assert any(record.get("skipped") == 1.0 for record in records)
    weights = load_file(tmp_path / "skip" / "epoch_0" / "adapter" / "adapter_model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
