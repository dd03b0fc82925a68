"""The old flat keys keep working for one release, each said once in one line (issue 39, item 3).

tests/fixtures/flat_configs/ holds every config shipped before the settings had sections, as it
was then; each must still validate, and map to exactly the settings of its migrated twin in
configs/.
"""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tunelab import _paths
from tunelab.cli import _check
from tunelab.cli._check import check_config, load_recipe_config
from tunelab.cli._discovery import load_recipe_args, resolve_recipe
from tunelab.cli.main import main
from tunelab.config import GRPOArgs, LoRADPOArgs, LoRAFinetuneArgs, load_config, parse_args
from tunelab.config._renamed import RENAMED, rename_old_keys
from tunelab.errors import ConfigError

FLAT = Path(__file__).resolve().parents[1] / "fixtures" / "flat_configs"
FLAT_CONFIGS = sorted(
    path.relative_to(FLAT).with_suffix("").as_posix() for path in FLAT.rglob("*.yaml")
)
TINY = _paths.assets_dir() / "tiny"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNELAB_DEBUG", raising=False)
    # A command says each mapping once per process; each test is a fresh command.
    monkeypatch.setattr(_check, "_SAID", set())
    return tmp_path


def _settings(name: str, folder: Path, overrides: list[str]) -> object:
    path = folder / f"{name}.yaml"
    recipe = OmegaConf.load(path).recipe
    args_cls = load_recipe_args(resolve_recipe(recipe))
    return OmegaConf.to_container(
        load_config(str(path), overrides, args_cls), resolve=False
    ), args_cls


@pytest.mark.parametrize("name", FLAT_CONFIGS)
def test_an_old_flat_config_maps_to_its_migrated_twin(name):
    # The same settings, key for key, as the shipped config written with sections.
    old, _ = _settings(name, FLAT, [])
    new, _ = _settings(name, _paths.configs_dir(), [])
    assert old == new


def test_every_config_shipped_before_sections_has_its_flat_twin():
    # The 51 configs shipped with flat keys (the release before sections); configs added since
    # were written with sections and never had a flat form.
    assert len(FLAT_CONFIGS) == 51
    shipped = {
        path.relative_to(_paths.configs_dir()).with_suffix("").as_posix()
        for path in _paths.configs_dir().rglob("*.yaml")
    }
    assert set(FLAT_CONFIGS) <= shipped


@pytest.mark.parametrize("name", [n for n in FLAT_CONFIGS if n.startswith("tiny/")])
def test_an_old_flat_tiny_config_validates(name, in_tmp, capsys):
    # The tiny configs need no download: they validate as they are (the others' model folders
    # are the only difference, checked by the twin test above).
    output = [] if name == "tiny/generate" else [f"output_dir={in_tmp / 'out'}"]
    check_config(str(FLAT / f"{name}.yaml"), output)
    err = capsys.readouterr().err
    if name not in ("tiny/eval", "tiny/generate"):
        assert (
            "tunelab: checkpoint_dir -> model.path (old flat key; it works until the next release)"
            in err
        )


def test_validate_says_each_mapping_once_in_one_line(in_tmp, capsys):
    old = str(FLAT / "tiny" / "lora.yaml")
    with pytest.raises(SystemExit) as info:
        main(["validate", old, "batch_size=4", "epochs=1", "profile=true"])
    assert info.value.code in (0, None)
    lines = capsys.readouterr().err.splitlines()
    notices = [line for line in lines if line.startswith("tunelab: ") and " -> " in line]
    assert (
        "tunelab: batch_size -> schedule.batch_size (old flat key; it works until the next release)"
        in notices
    )
    assert (
        "tunelab: profile -> profile.enabled (old flat key; it works until the next release)"
        in notices
    )
    assert len(notices) == len(set(notices))  # the file's batch_size and the override's: once


def test_old_overrides_reach_the_new_keys():
    cfg = load_config(
        "tiny/lora",
        ["batch_size=3", "~max_steps_per_epoch", "profile=true", "router_aux_loss_coef=0.5"],
        LoRAFinetuneArgs,
    )
    assert cfg.schedule.batch_size == 3 and "max_steps_per_epoch" not in cfg.schedule
    assert cfg.profile.enabled is True and cfg.router.aux_loss_coef == 0.5
    assert "batch_size" not in cfg and "profile_skip_first" not in cfg


def test_an_old_key_and_its_new_key_together_are_refused(tmp_path):
    text = (_paths.configs_dir() / "tiny" / "lora.yaml").read_text() + "\nbatch_size: 4\n"
    path = tmp_path / "both.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), [], LoRAFinetuneArgs)
    assert str(info.value) == (
        f"config {path} gives both 'batch_size' (the old flat key) and 'schedule.batch_size': "
        "keep 'schedule.batch_size'"
    )


def test_an_override_of_an_old_key_wins_over_the_new_key_in_the_file():
    cfg = load_config("tiny/lora", ["batch_size=5"], LoRAFinetuneArgs)
    assert cfg.schedule.batch_size == 5


def test_old_interpolations_follow_their_key(tmp_path):
    # tokenizer.path: ${checkpoint_dir} in an old config reads model.path.
    cfg, moved = rename_old_keys(
        OmegaConf.create({"checkpoint_dir": str(TINY), "tokenizer": {"path": "${checkpoint_dir}"}}),
        LoRAFinetuneArgs,
        "x.yaml",
    )
    assert moved == [("checkpoint_dir", "model.path")]
    assert cfg.tokenizer.path == str(TINY) and cfg.model.path == str(TINY)


def test_grpo_old_list_loss_keys_and_reward_paths_move():
    cfg = load_config(str(FLAT / "tiny" / "grpo.yaml"), ["beta=0.04"], GRPOArgs)
    assert cfg.rewards.functions[0]._component_ == "tunelab.rl.regex_reward"
    assert cfg.loss._component_ == "tunelab.rl.GRPOLoss" and cfg.loss.beta == 0.04
    assert cfg.rollout.num_generations == 4 and "num_generations" not in cfg


def test_a_key_a_recipe_keeps_at_the_top_is_not_moved():
    # The eval recipe's own batch_size and the generate recipe's sampling keys stay.
    cfg, _, _ = load_recipe_config("tiny/eval", ["batch_size=2"])
    assert cfg.batch_size == 2 and "schedule" not in cfg
    cfg, _, _ = load_recipe_config("tiny/generate", ["max_new_tokens=3", "temperature=0.5"])
    assert cfg.max_new_tokens == 3 and "rollout" not in cfg


def test_a_recipe_without_the_section_refuses_the_old_key(in_tmp):
    # DPO has no router section: the old key is not mapped into one, and stays unknown.
    with pytest.raises(ConfigError, match="unknown key 'router_aux_loss_coef'"):
        check_config("tiny/lora_dpo", ["router_aux_loss_coef=0.1"])


def test_every_old_key_names_a_real_setting():
    # Each target exists in at least one built-in recipe's settings (no stale table row).
    records = (
        LoRAFinetuneArgs,
        LoRADPOArgs,
        GRPOArgs,
        load_recipe_args(resolve_recipe("full_finetune_distributed")),
    )
    from tunelab.config._validate import key_paths

    known = {key for record in records for key in key_paths(record)}
    loss_arguments = {"loss.clip_eps_low", "loss.clip_eps_high", "loss.beta", "loss.aggregation"}
    missing = [new for new in RENAMED.values() if new not in known | loss_arguments]
    assert not missing


def test_the_parsed_settings_of_an_old_and_a_new_config_are_equal(in_tmp):
    old = parse_args(
        load_config(str(FLAT / "tiny" / "full.yaml"), ["output_dir=o"], _full()), _full()
    )
    new = parse_args(load_config("tiny/full", ["output_dir=o"], _full()), _full())
    assert old == new


def _full() -> type:
    return load_recipe_args(resolve_recipe("full_finetune_distributed"))
