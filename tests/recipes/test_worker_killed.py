"""A worker killed by a signal tunelab does not handle (SIGKILL, the OOM killer) is the cause.

Its rank and signal are named in the one error line, and the exit code is 128 + that signal (137),
never one of the "stopped, checkpoint committed" codes (143, 130) it used to be reported with,
under rank 0's consequent "Connection closed by peer" line.
"""

import signal
import subprocess

import pytest

from tests.recipes.conftest import RECIPE_TIMEOUT_S, TUNELAB, run_env
from tunelab import _paths
from tunelab.cli._run import STOPPED_EXIT_CODES

pytestmark = pytest.mark.slow

# The real LoRA recipe, with rank KILLED_RANK SIGKILLing itself in its third backward pass
# (what the OOM killer does to a worker mid-step).
KILLING_RECIPE = """
import os
import runpy
import signal

import torch

from tunelab.config.recipe_args import LoRAFinetuneArgs

ARGS = LoRAFinetuneArgs
backward = torch.Tensor.backward
calls = []


def killing_backward(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 3 and os.environ["RANK"] == os.environ["KILLED_RANK"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return backward(self, *args, **kwargs)


if __name__ == "__main__":
    torch.Tensor.backward = killing_backward
    runpy.run_path(os.environ["REAL_RECIPE"], run_name="__main__")
"""


def test_a_worker_killed_mid_training_is_named_with_its_signal_and_a_distinct_exit_code(tmp_path):
    recipe = tmp_path / "killing.py"
    recipe.write_text(KILLING_RECIPE)
    out = tmp_path / "run"
    real = _paths.recipes_dir() / "lora_finetune_distributed.py"
    result = subprocess.run(
        [TUNELAB, "run", "--nproc_per_node", "2", str(recipe), "--config", "tiny/lora",
         f"output_dir={out}", "schedule.epochs=1", "schedule.max_steps_per_epoch=8"],
        capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S,
        env=run_env(KILLED_RANK="1", REAL_RECIPE=str(real)),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 128 + signal.SIGKILL, output
    assert result.returncode not in STOPPED_EXIT_CODES, output
    errors = [line for line in output.splitlines() if line.startswith("tunelab: error:")]
    assert errors == [
        "tunelab: error: recipe killing failed on rank 1 (killed by SIGKILL, signal 9 "
        "(out of memory? the kernel's OOM killer sends it))"
    ], output
    assert "Traceback" not in output and "committed" not in output, output
