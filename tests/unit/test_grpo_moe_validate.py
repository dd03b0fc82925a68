"""`tunelab validate` refuses what a GRPO or MoE run would refuse (issue 38, findings 4 and 6).

Each case runs the real `tunelab validate` command line in this process and checks its one
error line: lengths past the model's context, no reward, a greedy group, and MoE expert counts
read from the model folder's config.json.
"""

import json
import shutil
from pathlib import Path

import pytest

from tunelab import _paths
from tunelab.cli.main import main
from tunelab.errors import ConfigError
from tunelab.models.gpt_oss import gpt_oss_args_from_hf
from tunelab.models.mixtral import mixtral_args_from_hf
from tunelab.models.qwen3_moe import qwen3_moe_args_from_hf

TINY_MOE = _paths.assets_dir() / "tiny_moe"


def validate(capsys, *argv: str) -> tuple[int, str]:
    """Run `tunelab validate ARGV`; its exit code and stderr."""
    with pytest.raises(SystemExit) as info:
        main(["validate", *argv])
    return info.value.code, capsys.readouterr().err


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNELAB_DEBUG", raising=False)
    return tmp_path


@pytest.mark.parametrize(
    ("override", "expect"),
    [
        (
            "rollout.max_new_tokens=1000000000",
            "key 'rollout.max_new_tokens': 1000000000 tokens leave no room for a prompt in the model's "
            "context (max_position_embeddings 512 of",
        ),
        ("rollout.max_new_tokens=512", "lower rollout.max_new_tokens below 512"),
        (
            "dataset.max_prompt_tokens=501",
            "key 'dataset.max_prompt_tokens': 501 prompt tokens + rollout.max_new_tokens 12 = 513 exceed "
            "the model's context",
        ),
        ("rewards.functions=[]", "key 'rewards.functions': give at least one reward function"),
        (
            "rollout.temperature=0",
            "key 'rollout.temperature': 0 samples greedily, so the rollout.num_generations=4 completions of a "
            "prompt are the same tokens with the same reward: every advantage is 0",
        ),
    ],
)
def test_validate_refuses_grpo_settings_a_run_cannot_use(in_tmp, capsys, override, expect):
    code, err = validate(capsys, "tiny/grpo", f"output_dir={in_tmp}/out", override)
    assert code == 1 and expect in err, err
    assert "Traceback" not in err


def test_validate_takes_a_prompt_cap_that_fits(in_tmp, capsys):
    code, _ = validate(
        capsys, "tiny/grpo", f"output_dir={in_tmp}/out", "dataset.max_prompt_tokens=500"
    )
    assert code == 0


def _moe_folder(tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "moe"
    shutil.copytree(TINY_MOE, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("changes", "expect"),
    [
        ({"num_local_experts": 0}, "num_local_experts must be a positive integer, got 0"),
        (
            {"num_experts_per_tok": 5},
            "num_experts_per_tok 5 is more than the 4 experts (num_local_experts)",
        ),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok must be a positive integer, got 0"),
    ],
)
def test_validate_refuses_expert_counts_the_model_cannot_have(in_tmp, capsys, changes, expect):
    folder = _moe_folder(in_tmp, **changes)
    code, err = validate(
        capsys, "tiny/moe_lora", f"output_dir={in_tmp}/out", f"model.path={folder}"
    )
    assert code == 1 and f"{folder}/config.json: {expect}" in err, err


def test_zero_experts_is_refused_not_read_as_the_default():
    config = json.loads((TINY_MOE / "config.json").read_text())
    assert mixtral_args_from_hf(config).num_experts == 4
    # Before: `num_local_experts or ... or 8` turned 0 into 8 experts.
    with pytest.raises(ConfigError, match="num_local_experts must be a positive integer, got 0"):
        mixtral_args_from_hf({**config, "num_local_experts": 0})
    with pytest.raises(ConfigError, match="num_experts must be a positive integer, got 0"):
        qwen3_moe_args_from_hf({**config, "model_type": "qwen3_moe", "num_experts": 0})
    with pytest.raises(ConfigError, match="num_experts_per_tok 9 is more than the 4 experts"):
        gpt_oss_args_from_hf({**config, "model_type": "gpt_oss", "num_experts_per_tok": 9})
    # Absent keys keep each family's default.
    defaults = {k: v for k, v in config.items() if k not in ("num_local_experts", "num_experts")}
    assert mixtral_args_from_hf(defaults).num_experts == 8
