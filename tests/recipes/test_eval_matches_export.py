"""Scores logged by evaluation during training equal ``tunelab run eval`` on that step's export.

The run is tiny/lora with LoRA dropout (0.3), so an evaluation that forgot ``model.eval()``
(scoring with dropout on) would give other scores. It evaluates after its last step
(``eval.at_end``), whose weights are the ``epoch_0`` export; the ``eval`` recipe then scores
that merged export on 2 processes with the same lm-eval settings (batch size, generation
length, document limit, seed). Live (sharded, adapters unmerged) and exported (merged) models
differ by fp32 rounding only: the perplexity agrees to 1e-5 relative and the greedy answers'
exact match is equal.
"""

import json

import pytest

from tests.recipes.conftest import read_metrics, tunelab_run
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow
pytest.importorskip("lm_eval")

TASKS = assets_dir() / "tiny_eval"
TASK_FILES = f"[{TASKS / 'reverse_words_length.yaml'},{TASKS / 'reverse_words_perplexity.yaml'}]"
LENGTH = "tiny_reverse_words_length/exact_match"
PERPLEXITY = "tiny_reverse_words_perplexity/perplexity"
STEPS = 4
# The lm-eval settings both sides share (the training eval.* and the eval recipe's own keys).
SHARED = {"limit": 8, "batch_size": 8, "max_gen_toks": 256, "seed": 0}


def test_scores_during_training_equal_the_eval_recipe_on_the_steps_export(tmp_path):
    out = tmp_path / "run"
    tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", "schedule.batch_size=8",
        "lora.dropout=0.3", "schedule.epochs=1", f"schedule.max_steps_per_epoch={STEPS}",
        "lr_scheduler.num_warmup_steps=0", "schedule.run_val_every_n_steps=null",
        "checkpoint.save_every_n_steps=null", f"eval.tasks={TASK_FILES}", "eval.at_end=true",
        *(f"eval.{key}={value}" for key, value in SHARED.items()),
    )  # fmt: skip
    (logged,) = [row for row in read_metrics(out) if any(k.startswith("eval/") for k in row)]
    assert logged["step"] == STEPS  # the last step: its weights are epoch_0's

    scored = tmp_path / "eval"
    tunelab_run(
        "eval", "tiny/eval", f"model.path={out / 'epoch_0'}", f"output_dir={scored}",
        f"tasks={TASK_FILES}", "num_fewshot=null",
        *(f"{key}={value}" for key, value in SHARED.items()),
    )  # fmt: skip
    results = json.loads((scored / "results.json").read_text())["results"]
    recipe = {
        f"{task}/{key.split(',')[0]}": value
        for task, scores in results.items()
        for key, value in scores.items()
        if key.endswith(",none") and "_stderr" not in key
    }
    print(f"perplexity: during training {logged[f'eval/{PERPLEXITY}']!r}, "
          f"eval recipe {recipe[PERPLEXITY]!r}")  # fmt: skip
    assert logged[f"eval/{LENGTH}"] == recipe[LENGTH]
    assert logged[f"eval/{PERPLEXITY}"] == pytest.approx(recipe[PERPLEXITY], rel=1e-5, abs=0)
