"""Loading configs, overrides, interpolation and the assets resolver."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tunelab import _paths
from tunelab.config import apply_overrides, builtin_configs, load_config, resolve_config_path
from tunelab.errors import ConfigError


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def config_file(tmp_path):
    return write(
        tmp_path / "c.yaml",
        "recipe: toy\nlr: 0.001\nbatch_size: 4\nmodel:\n  dim: 8\n  layers: [a, b]\n"
        "output_dir: /out/${model.dim}\n",
    )


def test_load_yaml_file(config_file):
    cfg = load_config(str(config_file))
    assert cfg.recipe == "toy"
    assert cfg.lr == 0.001
    assert cfg.model.layers == ["a", "b"]


def test_interpolation_follows_overrides(config_file):
    cfg = load_config(str(config_file), ["model.dim=16"])
    assert cfg.output_dir == "/out/16"


def test_overrides_parse_values_as_yaml(config_file):
    cfg = load_config(
        str(config_file),
        [
            "lr=3e-4",
            "wd=[1e-2, 2]",
            "batch_size=8",
            "model.layers=[x, y, z]",
            "name=null",
            "flag=true",
            "s=abc",
            "empty=",
        ],
    )
    assert cfg.lr == pytest.approx(3e-4) and isinstance(cfg.lr, float)
    assert list(cfg.wd) == [0.01, 2]
    assert cfg.batch_size == 8 and isinstance(cfg.batch_size, int)
    assert list(cfg.model.layers) == ["x", "y", "z"]
    assert cfg.name is None
    assert cfg.flag is True
    assert cfg.s == "abc"
    assert cfg.empty == ""


def test_override_creates_nested_keys_and_list_index(config_file):
    cfg = load_config(str(config_file), ["a.b.c=5", "model.layers.1=q"])
    assert cfg.a.b.c == 5
    assert list(cfg.model.layers) == ["a", "q"]


def test_mapping_override_replaces_the_node(config_file):
    cfg = load_config(str(config_file), ["model={_component_: x.Y, k: 1}"])
    assert OmegaConf.to_container(cfg.model) == {"_component_": "x.Y", "k": 1}


def test_delete_override(config_file):
    cfg = load_config(str(config_file), ["~lr", "~model.dim"])
    assert "lr" not in cfg
    assert "dim" not in cfg.model
    assert "layers" in cfg.model


def test_delete_missing_key_names_it(config_file):
    with pytest.raises(ConfigError, match="no key 'model.depth'"):
        load_config(str(config_file), ["~model.depth"])


@pytest.mark.parametrize("override", ["lr", "=3", "a..b=1", "~", "~a=1", "a b=1", "-x=1"])
def test_bad_override_syntax(config_file, override):
    with pytest.raises(ConfigError, match=f"bad override '{override}'"):
        apply_overrides(load_config(str(config_file)), [override])


def test_bad_override_value_yaml(config_file):
    with pytest.raises(ConfigError, match=r"bad override 'x=\[1,'"):
        load_config(str(config_file), ["x=[1,"])


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path / "bad.yaml", "a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    message = str(info.value)
    assert str(path) in message
    assert "line 3" in message
    assert "\n" not in message


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(str(write(tmp_path / "l.yaml", "- 1\n- 2\n")))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))


def test_unknown_builtin_name(monkeypatch, tmp_path):
    write(tmp_path / "tiny" / "lora.yaml", "recipe: x\n")
    monkeypatch.setattr(_paths, "configs_dir", lambda: tmp_path)
    with pytest.raises(ConfigError, match="unknown config 'tiny/lorra'.*did you mean 'tiny/lora'"):
        load_config("tiny/lorra")


def test_builtin_configs_found_recursively(monkeypatch, tmp_path):
    write(tmp_path / "tiny" / "lora.yaml", "recipe: x\nk: 1\n")
    write(tmp_path / "llama3" / "8B" / "full.yml", "recipe: y\n")
    write(tmp_path / "README.md", "not a config")
    monkeypatch.setattr(_paths, "configs_dir", lambda: tmp_path)
    assert list(builtin_configs()) == ["llama3/8B/full", "tiny/lora"]
    assert resolve_config_path("tiny/lora") == tmp_path / "tiny" / "lora.yaml"
    assert load_config("tiny/lora").k == 1


def test_assets_resolver(tmp_path):
    path = write(tmp_path / "a.yaml", "model_dir: ${assets:tiny_llama}\n")
    assert load_config(str(path)).model_dir == str(_paths.assets_dir() / "tiny_llama")


# -- text settings take override values literally ---------------------------------------------

TEXTS = {
    "colon-space": "Reverse the words: red cat sun",
    "hash": "runs/exp #3",
    "leading dash": "- a list? no",
    "braces": "{not: a mapping}",
    "brackets": "[not, a, list]",
    "newline": "line one\nline two",
    "quotes": "'kept' \"as typed\"",
    "a number": "42",
    "a bool word": "true",
    "tab and trailing space": "a\tb ",
}


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
@pytest.mark.parametrize("key", ["prompt", "model.path", "input"])
def test_a_text_setting_takes_the_value_as_typed(key, text):
    from tunelab.config import GenerateArgs

    cfg = load_config("tiny/generate", [f"{key}={text}"], GenerateArgs)
    assert OmegaConf.select(cfg, key) == text


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
@pytest.mark.parametrize(
    "key",
    [
        "output_dir",  # a top-level path
        "tokenizer.path",  # a built-in component's path argument
        "metric_loggers.0.log_dir",  # inside a list of components
        "dataset.split",
    ],
)
def test_a_text_setting_nested_or_in_a_component_takes_the_value_as_typed(key, text):
    from tunelab.config import LoRAFinetuneArgs

    cfg = load_config("tiny/lora", [f"{key}={text}"], LoRAFinetuneArgs)
    assert OmegaConf.select(cfg, key) == text


def test_other_settings_keep_yaml_and_null_still_means_none_where_allowed():
    from tunelab.config import GenerateArgs, LoRAFinetuneArgs

    cfg = load_config(
        "tiny/lora",
        [
            "schedule.epochs=2",
            "lora.targets=[q_proj, v_proj]",
            "checkpoint.resume_from_checkpoint=true",  # bool | 'auto': not text
            "schedule.clip_grad_norm=null",
            "lora.quantize_base=null",  # Literal['nf4'] | None
            "optimizer.lr=1e-3",
            "output_dir=null",  # a text setting that allows no None gets the word
        ],
        LoRAFinetuneArgs,
    )
    assert cfg.schedule.epochs == 2 and list(cfg.lora.targets) == ["q_proj", "v_proj"]
    assert cfg.checkpoint.resume_from_checkpoint is True
    assert cfg.schedule.clip_grad_norm is None and cfg.lora.quantize_base is None
    assert cfg.optimizer.lr == pytest.approx(1e-3)
    assert cfg.output_dir == "null"
    generate = load_config("tiny/generate", ["template=null", "input=~"], GenerateArgs)
    assert generate.template is None and generate.input is None


def test_without_settings_the_recipe_key_names_them():
    # `tunelab run`, `validate` and `data preview` load configs through the CLI, which finds
    # the settings class from the config's recipe, so an override means the same everywhere.
    from tunelab.cli._check import load_recipe_config

    cfg, _, _ = load_recipe_config("tiny/lora", ["output_dir=runs/exp #3", "schedule.epochs=2"])
    assert cfg.output_dir == "runs/exp #3" and cfg.schedule.epochs == 2


def test_without_a_known_recipe_every_value_is_yaml(config_file):
    from tunelab.cli._check import load_recipe_config

    assert load_config(str(config_file), ["output_dir=runs/exp #3"]).output_dir == "runs/exp"
    cfg, _, recipe = load_recipe_config(str(config_file), ["output_dir=runs/exp #3"])
    assert recipe is None and cfg.output_dir == "runs/exp"
