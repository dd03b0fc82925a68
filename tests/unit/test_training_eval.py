"""``tunelab.eval.TrainingEval`` and the ``eval.*`` settings, in one process on the tiny model.

The evaluation must leave training as it found it: the global random streams lm-eval seeds
(Python, NumPy, torch) and the model's train mode. The settings refuse a schedule without
tasks, tasks without a schedule, a missing task file and (when lm-eval is absent) tasks at all.
"""

import importlib.util
import random

import numpy as np
import pytest
import torch

from tunelab import ConfigError, _paths
from tunelab.config import LoRAFinetuneArgs, TrainingEvalArgs, parse_args
from tunelab.config._load import load_config
from tunelab.eval import TrainingEval, task_metrics

TASKS = _paths.assets_dir() / "tiny_eval"
TINY = _paths.assets_dir() / "tiny"


@pytest.fixture(scope="module")
def model_and_tokenizer():
    pytest.importorskip("lm_eval")
    from tunelab.data import load_tokenizer
    from tunelab.models import load_pretrained

    return load_pretrained(TINY), load_tokenizer(TINY)


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_an_evaluation_leaves_the_random_streams_and_train_mode_as_they_were(
    model_and_tokenizer,
):
    model, tokenizer = model_and_tokenizer
    settings = TrainingEvalArgs(
        tasks=[str(TASKS / "reverse_words_perplexity.yaml"), str(TASKS / "reverse_words.yaml")],
        limit=3,
        max_gen_toks=4,
    )
    evaluation = TrainingEval(settings, model, tokenizer)
    model.train()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    expected = _draws()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    metrics = evaluation()
    assert _draws() == expected  # lm-eval seeded all three: restored
    assert model.training
    assert set(metrics) == {
        "eval/tiny_reverse_words_perplexity/perplexity",
        "eval/tiny_reverse_words/exact_match",
        "eval/time_s",
    }
    # The same model and settings score the same (lm-eval's own seeds, not the training's).
    torch.manual_seed(123)
    again = evaluation()
    assert {k: v for k, v in again.items() if k != "eval/time_s"} == {
        k: v for k, v in metrics.items() if k != "eval/time_s"
    }


def test_due_every_n_steps_and_at_the_end(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    task = [str(TASKS / "reverse_words_perplexity.yaml")]
    every_3 = TrainingEval(TrainingEvalArgs(tasks=task, every_n_steps=3), model, tokenizer)
    assert [step for step in range(1, 8) if every_3.due(step, step == 7)] == [3, 6, 7]
    no_end = TrainingEval(
        TrainingEvalArgs(tasks=task, every_n_steps=3, at_end=False), model, tokenizer
    )
    assert [step for step in range(1, 8) if no_end.due(step, step == 7)] == [3, 6]
    nothing = TrainingEval(TrainingEvalArgs(every_n_steps=None), model, tokenizer)
    assert not nothing.enabled and not nothing.due(7, True)


def test_an_unknown_task_file_is_refused_when_built(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ConfigError, match="no such task file"):
        TrainingEval(TrainingEvalArgs(tasks=[str(tmp_path / "nope.yaml")]), model, tokenizer)


def test_task_metrics_names():
    results = {
        "results": {
            "gsm8k": {
                "alias": "gsm8k",
                "exact_match,strict-match": 0.25,
                "exact_match_stderr,strict-match": 0.01,
                "exact_match,flexible-extract": 0.5,
                "exact_match_stderr,flexible-extract": "N/A",
            },
            "arc_easy": {"alias": "arc_easy", "acc,none": 0.75, "acc_norm,none": 0.5},
        }
    }
    assert task_metrics(results) == {
        "eval/gsm8k/exact_match,strict-match": 0.25,
        "eval/gsm8k/exact_match,flexible-extract": 0.5,
        "eval/arc_easy/acc": 0.75,
        "eval/arc_easy/acc_norm": 0.5,
    }


def _problems(*overrides: str) -> list[str]:
    config = load_config("tiny/lora", list(overrides))
    try:
        parse_args(config, LoRAFinetuneArgs)
    except ConfigError as error:
        lines = str(error).splitlines()
        # One problem is the message; several come as "N problems ...:" and "  - ..." lines.
        return [line.removeprefix("  - ") for line in (lines[1:] if len(lines) > 1 else lines)]
    return []


def test_settings_refuse_a_schedule_without_tasks_and_tasks_without_one(tmp_path):
    output = f"output_dir={tmp_path / 'out'}"
    assert _problems(output, "eval.every_n_steps=10") == [
        "key 'eval.every_n_steps': there are no eval.tasks to evaluate"
    ]
    task = TASKS / "reverse_words.yaml"
    assert _problems(output, f"eval.tasks=[{task}]", "eval.at_end=false") == [
        "key 'eval.tasks': no evaluation is scheduled: set eval.every_n_steps or eval.at_end: true"
    ]
    assert _problems(output, f"eval.tasks=[{tmp_path / 'nope.yaml'}]") == [
        f"key 'eval.tasks': task '{tmp_path / 'nope.yaml'}': no such task file or folder"
    ]
    assert _problems(output, "eval.limit=0")[0].startswith("key 'eval.limit': expected int >= 1")
    assert _problems(output, f"eval.tasks=[{task}]", "eval.every_n_steps=5") == []


def test_settings_say_how_to_install_lm_eval_when_tasks_need_it(monkeypatch, tmp_path):
    # lm-eval is installed here: the check asks importlib, so make it answer "absent".
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else find_spec(name)
    )
    problems = _problems(
        f"output_dir={tmp_path / 'out'}", f"eval.tasks=[{TASKS / 'reverse_words.yaml'}]"
    )
    assert problems == [
        "key 'eval.tasks': evaluation needs EleutherAI's lm-evaluation-harness (lm_eval): "
        "pip install 'tunelab[eval]'"
    ]
