"""Text overrides reach the recipe as typed, through the real ``tunelab run``.

YAML would read ``prompt=Reverse the words: red cat sun`` as a mapping (the documented generate
example failed) and the ``#3`` of ``output_dir=runs/exp #3`` as a comment (a resume then found
another run's folder, ``runs/exp``).
"""

import subprocess

import pytest

from tests.recipes.conftest import RECIPE_TIMEOUT_S, TUNELAB, run_env

pytestmark = pytest.mark.slow


def _run(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TUNELAB, "run", *args], capture_output=True, text=True, env=run_env(), cwd=cwd,
        timeout=RECIPE_TIMEOUT_S,
    )  # fmt: skip


def test_the_documented_generate_example_runs(tmp_path):
    result = _run(
        "generate", "--config", "tiny/generate", "prompt=Reverse the words: red cat sun",
        "max_new_tokens=4", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()


def test_an_output_dir_with_a_hash_is_that_folder(tmp_path):
    result = _run(
        "lora_finetune_distributed", "--config", "tiny/lora", "output_dir=runs/exp #3",
        "checkpoint.resume_from_checkpoint=auto", "schedule.epochs=1", "schedule.max_steps_per_epoch=2",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished at step 2; outputs in runs/exp #3" in result.stdout
    assert sorted(path.name for path in (tmp_path / "runs").iterdir()) == ["exp #3"]
    assert (tmp_path / "runs" / "exp #3" / "step_2").is_dir()
