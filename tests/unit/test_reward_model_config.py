"""reward_model_distributed's settings: lm-eval tasks are refused (a classifier has no LM head)."""

import pytest

from tunelab import ConfigError
from tunelab.config import RewardModelArgs, parse_args
from tunelab.config._load import load_config


def test_eval_tasks_are_refused_for_a_reward_model_in_one_line(tmp_path):
    task = tmp_path / "task.yaml"
    task.write_text("task: toy\n")
    config = load_config("tiny/reward_model", [f"eval.tasks=[{task}]", "eval.at_end=true"])
    with pytest.raises(ConfigError) as refused:
        parse_args(config, RewardModelArgs)
    lines = [line for line in str(refused.value).splitlines() if "eval.tasks" in line]
    assert len(lines) == 1 and "sequence classifier" in lines[0], str(refused.value)


def test_the_shipped_config_has_no_eval_tasks_and_parses():
    args = parse_args(load_config("tiny/reward_model", []), RewardModelArgs)
    assert not args.eval.tasks
