"""lm-eval tasks during training (``eval.*``), real ``tunelab run`` on 2 processes.

The tasks are the tiny reverse-words tasks shipped in assets/tiny_eval: the answer format
(exact match of the word count, generation) and the reference answer's perplexity (a
log-likelihood score that moves with every step). One uninterrupted LoRA run evaluates at
step 4 (``every_n_steps``) and after its last step 6 (``at_end``); its losses equal those of
the same run without evaluation (``lora_2p``), so the evaluations leave training alone. A run
killed after its step-4 evaluation was logged, while step_4's checkpoint write is held
uncommitted, resumes from step_2: losses and scores equal the uninterrupted run's, and each
evaluated step is in the metric file exactly once. The other training recipes log their
scores too.
"""

import json
import math
import os
import signal
import subprocess

import pytest

from tests.recipes.conftest import (
    COMMON,
    TUNELAB,
    losses_by_step,
    read_metrics,
    run_env,
    tunelab_run,
)
from tests.recipes.test_sft_recipes import HELD_WRAPPER, _is_committed, _wait_for
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval")

TASKS = assets_dir() / "tiny_eval"
LENGTH = "eval/tiny_reverse_words_length/exact_match"
PERPLEXITY = "eval/tiny_reverse_words_perplexity/perplexity"
EVAL = [
    f"eval.tasks=[{TASKS / 'reverse_words_length.yaml'},{TASKS / 'reverse_words_perplexity.yaml'}]",
    "eval.every_n_steps=4",
    "eval.at_end=true",
    "eval.limit=4",
    "checkpoint.save_every_n_steps=2",  # step_2, step_4 (async, as tiny/lora) and step_6
]
EVAL_STEPS = [4, 6]


def _evals(out) -> list[dict]:
    """The metric file's evaluation records, in file order."""
    return [row for row in read_metrics(out) if any(key.startswith("eval/") for key in row)]


def _scores(row: dict) -> dict:
    return {key: value for key, value in row.items() if key != "eval/time_s"}


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    """tiny/lora as ``lora_2p`` (COMMON, batch 8), evaluating at step 4 and at the end."""
    out = tmp_path_factory.mktemp("eval_run") / "run"
    tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", "schedule.batch_size=8", *COMMON,
        *EVAL,
    )  # fmt: skip
    return out


def test_scores_are_logged_at_the_scheduled_steps_and_at_the_end(eval_run, lora_2p):
    evals = _evals(eval_run)
    assert [row["step"] for row in evals] == EVAL_STEPS
    for row in evals:
        assert set(row) == {"step", LENGTH, PERPLEXITY, "eval/time_s"}, row
        assert 0 <= row[LENGTH] <= 1
        assert math.isfinite(row[PERPLEXITY]) and row[PERPLEXITY] > 1
        assert row["eval/time_s"] > 0
    # The model changed between the two evaluations, and the score saw it.
    assert evals[0][PERPLEXITY] != evals[1][PERPLEXITY]
    # Training is the run's without evaluation, bit for bit (train mode, shards, RNG restored).
    assert losses_by_step(eval_run) == losses_by_step(lora_2p)
    # Training records keep their own tokens/s; evaluation records carry only eval/ metrics.
    training = [row for row in read_metrics(eval_run) if "loss" in row]
    assert all("tokens_per_second" in row and "eval/time_s" not in row for row in training)


def test_kill_after_an_evaluation_and_resume_logs_each_evaluation_once(eval_run, tmp_path):
    """SIGKILL after step 4's scores are logged but before step_4 commits; resume from step_2."""
    recipe = tmp_path / "held_lora.py"
    recipe.write_text(HELD_WRAPPER)
    out, gates = tmp_path / "run", tmp_path / "gates"
    gates.mkdir()
    (gates / "step_4.hold").touch()
    command = [
        TUNELAB, "run", "--nproc_per_node", "2", str(recipe), "--config", "tiny/lora",
        f"output_dir={out}", "schedule.batch_size=8", *COMMON, *EVAL,
    ]  # fmt: skip
    process = subprocess.Popen(
        command, env=run_env(TUNELAB_TEST_WRITE_GATES=str(gates)), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_for(lambda: _logged_eval_steps(out) >= {4}, process, "step 4's scores")
        _wait_for((gates / "step_4.writing").exists, process, "step_4's write at its gate")
        assert not _is_committed(out, 4), "step_4 committed while its write was held"
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert _is_committed(out, 2) and not _is_committed(out, 4)
    killed_evals = [row["step"] for row in _evals(out)]
    assert 4 in killed_evals  # logged before the kill: the resume must not log it twice

    tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", "schedule.batch_size=8", *COMMON,
        *EVAL, "checkpoint.resume_from_checkpoint=true",
    )  # fmt: skip
    resumed = _evals(out)
    assert [row["step"] for row in resumed] == EVAL_STEPS
    expected = _evals(eval_run)
    for ours, theirs in zip(resumed, expected, strict=True):
        assert _scores(ours) == _scores(theirs)
    assert losses_by_step(out) == losses_by_step(eval_run)


def _logged_eval_steps(out) -> set[int]:
    """Steps with scores in metrics.jsonl so far (complete lines only: it is being written)."""
    path = out / "logs" / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    lines = [line for line in text.splitlines(keepends=True) if line.endswith("\n")]
    return {json.loads(line)["step"] for line in lines if '"eval/' in line}


@pytest.mark.parametrize(
    ("recipe", "config"),
    [
        ("full_finetune_distributed", "tiny/full"),
        ("lora_dpo_distributed", "tiny/lora_dpo"),
        ("grpo_distributed", "tiny/grpo"),
    ],
)
def test_the_other_training_recipes_log_scores_at_the_end(tmp_path, recipe, config):
    out = tmp_path / "run"
    tunelab_run(
        recipe, config, f"output_dir={out}", "schedule.epochs=1", "schedule.max_steps_per_epoch=2",
        "checkpoint.save_every_n_steps=null",
        f"eval.tasks=[{TASKS / 'reverse_words_perplexity.yaml'}]", "eval.limit=2",
    )  # fmt: skip
    (row,) = _evals(out)
    assert row["step"] == 2
    assert set(row) == {"step", PERPLEXITY, "eval/time_s"}
    assert math.isfinite(row[PERPLEXITY]) and row[PERPLEXITY] > 1


HUB_TASK = """task: tiny_hub_task
dataset_path: tunelab-tests/no-such-dataset
test_split: test
output_type: loglikelihood
doc_to_text: "{{text}}"
doc_to_target: "{{target}}"
metric_list:
  - metric: perplexity
"""


def test_a_task_whose_data_needs_the_hub_offline_stops_the_run_before_its_first_step(tmp_path):
    """One error line naming the task, before any step (1 process: the check is per rank)."""
    task = tmp_path / "hub_task.yaml"
    task.write_text(HUB_TASK)
    out = tmp_path / "run"
    command = [
        TUNELAB, "run", "lora_finetune_distributed", "--config", "tiny/lora", f"output_dir={out}",
        *COMMON, f"eval.tasks=[{task}]",
    ]  # fmt: skip
    env = run_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("tunelab: error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(
        "tunelab: error: task 'tiny_hub_task': its dataset could not be loaded without the "
        "Hugging Face Hub"
    ), errors[0]
    assert not (out / "logs" / "metrics.jsonl").exists() or not losses_by_step(out)
