"""``tunelab.eval.TrainingEval`` and the ``eval.*`` settings, in one process on the tiny model.

The evaluation must leave training as it found it: the global random streams lm-eval seeds
(Python, NumPy, torch) and the model's train mode. The settings refuse a schedule without
tasks, tasks without a schedule, a missing task file and (when lm-eval is absent) tasks at all.
"""

import importlib.util
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tunelab import ConfigError, _paths
from tunelab.cli._check import check_config
from tunelab.config import LoRAFinetuneArgs, TrainingEvalArgs, builtin_configs, parse_args
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


def test_a_task_folder_runs_from_any_working_directory(model_and_tokenizer, tmp_path, monkeypatch):
    """Every task of assets/tiny_eval, whose data files are named relative to the folder."""
    model, tokenizer = model_and_tokenizer
    monkeypatch.chdir(tmp_path)
    settings = TrainingEvalArgs(tasks=[str(TASKS)], limit=2, max_gen_toks=4)
    metrics = TrainingEval(settings, model, tokenizer)()
    assert {name.split("/")[1] for name in metrics if name != "eval/time_s"} == {
        "tiny_next_number",
        "tiny_repeat_words",
        "tiny_reverse_words",
        "tiny_reverse_words_length",
        "tiny_reverse_words_perplexity",
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


def _configs_with_an_eval_block() -> list[Path]:
    return sorted(path for path in builtin_configs().values() if "\n# eval:\n" in path.read_text())


def test_the_llama_and_qwen_training_configs_carry_an_eval_block():
    names = {path.relative_to(_paths.configs_dir()).parent.name for path in
             _configs_with_an_eval_block()}  # fmt: skip
    assert names == {"llama3_1", "llama3_2", "qwen2_5", "qwen3"}
    # Every recipe that trains a language model takes the block; a reward model is a
    # classifier, which lm-eval's generation and log-likelihood tasks cannot score.
    shipped = [
        path for path in builtin_configs().values()
        if path.parent.name in names
        and not re.search(r"^recipe: (eval|reward_model_distributed)$", path.read_text(), re.M)
    ]  # fmt: skip
    assert sorted(shipped) == _configs_with_an_eval_block()


@pytest.mark.parametrize("path", _configs_with_an_eval_block(), ids=lambda path: path.stem)
def test_an_uncommented_eval_block_validates(path, tmp_path, monkeypatch, tiny_long_context):
    """The block as a user uncomments it (the model folder replaced by the tiny one, with the
    long context of the models these configs are for: their lengths are checked against it)."""
    monkeypatch.chdir(tmp_path)  # relative output_dirs are made under the test's folder
    lines = path.read_text().splitlines()
    start = lines.index("# eval:")
    block = [line.removeprefix("# ") for line in lines[start:] if line.startswith("# ")]
    copy = tmp_path / path.name
    copy.write_text("\n".join([*lines[:start], *block]) + "\n")
    overrides = [f"model.path={tiny_long_context}"]
    if "\nteacher:\n" in copy.read_text():  # a distillation config's teacher, likewise
        overrides.append(f"teacher.path={tiny_long_context}")
    config = load_config(str(copy), overrides)
    assert list(config["eval"]["tasks"])  # the block was read
    check_config(str(copy), overrides)
