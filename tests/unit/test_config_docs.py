"""Every recipe setting has a one-line docstring; every shipped config validates; the
generated settings tables in docs/settings.md match the declarations."""

import dataclasses
import importlib
import pkgutil
import re
import typing
from pathlib import Path

import pytest

import tunelab.config
from tunelab import _paths
from tunelab.cli import builtin_recipes, load_recipe_args, settings_docs
from tunelab.cli._check import check_config
from tunelab.config import RecipeArgs, builtin_configs, field_docs
from tunelab.errors import ConfigError


def _import_config_package() -> None:
    # Recipe settings live in tunelab.config (recipe_args.py) and in the recipe scripts.
    for module in pkgutil.walk_packages(tunelab.config.__path__, "tunelab.config."):
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as err:
            # An optional third-party dependency (wandb, tensorboard) may be absent.
            if err.name is None or err.name.split(".")[0] == "tunelab":
                raise


def _settings_classes() -> set[type]:
    _import_config_package()
    for path in builtin_recipes().values():
        load_recipe_args(path)
    found: set[type] = set()
    todo = [RecipeArgs]
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.add(cls)
        todo.extend(cls.__subclasses__())
        for hint in typing.get_type_hints(cls).values():
            for candidate in (hint, *typing.get_args(hint)):
                if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
                    todo.append(candidate)
    return found


def test_every_settings_field_has_a_one_line_docstring():
    undocumented = []
    for cls in sorted(_settings_classes(), key=lambda c: c.__qualname__):
        docs = field_docs(cls)
        for field in dataclasses.fields(cls):
            doc = docs.get(field.name, "")
            if not doc or "\n" in doc:
                undocumented.append(f"{cls.__module__}.{cls.__qualname__}.{field.name}")
    assert undocumented == []


SHIPPED = builtin_configs()


TINY = _paths.assets_dir() / "tiny"


@pytest.mark.skipif(not SHIPPED, reason="configs/ holds no YAML files yet")
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_validates_against_its_recipe(
    name, tmp_path, monkeypatch, tiny_long_context
):
    monkeypatch.chdir(tmp_path)  # Relative output_dirs are created under the test's folder.
    text = SHIPPED[name].read_text()
    # The base model: every recipe's model.path.
    folder = re.search(r"^model:\n(?:  .*\n)*?  path: (\S+)$", text, re.MULTILINE).group(1)
    key = "model.path"
    overrides = []
    # A distillation config's teacher (built or downloaded first): the tiny model stands in.
    teacher = re.search(r"^teacher:\n(?:  .*\n)*?  path: (\S+)$", text, re.MULTILINE)
    if teacher and not Path(teacher.group(1)).exists():
        overrides = [f"teacher.path={TINY}"]
    if not folder.startswith("${") and not Path(folder).exists():
        # A real model the machine has not downloaded: the only problem is the missing folder,
        # and the message gives the download command the config's own comment gives.
        with pytest.raises(ConfigError) as info:
            check_config(name, overrides)
        download = re.search(r"tunelab download \S+ --output-dir \S+", text)
        if download is not None:
            assert str(info.value) == (
                f"key '{key}': model folder not found: {folder}; download it with "
                f"`{download.group(0)}`"
            )
        else:
            # A model another shipped run makes (tiny/agentic_grpo starts from tiny/agentic_sft):
            # the message gives the run its header gives first.
            recipe, made_by = re.search(
                r"tunelab run --nproc_per_node 2 (\S+) --config (\S+)\n", text
            ).groups()
            assert made_by != name
            assert str(info.value) == (
                f"key '{key}': model folder not found: {folder}; it is made by the shipped "
                f"config {made_by}: run `tunelab run --nproc_per_node 2 {recipe} --config "
                f"{made_by}` first"
            )
        # Everything else must validate, against the tiny model with the context of the
        # model the config is for (its lengths are checked against max_position_embeddings).
        overrides += [f"{key}={tiny_long_context}"]
    config_path, recipe_path = check_config(name, overrides)
    assert config_path == SHIPPED[name]
    assert recipe_path.is_file()


def test_settings_docs_are_generated_from_the_declarations():
    # Fails when a setting, a default, a rule or a docstring changed without the docs:
    # run `python -m tunelab.cli.settings_docs` to regenerate docs/settings.md.
    expected = settings_docs.settings_markdown(settings_docs.builtin_settings())
    path = settings_docs.default_output()
    assert path.read_text() == expected, (
        "docs/settings.md is stale: python -m tunelab.cli.settings_docs"
    )
    assert settings_docs.main(["--check"]) == 0


def test_settings_docs_check_detects_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "settings.md"
    stale.write_text("# Settings\n")
    assert settings_docs.main([str(stale), "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert settings_docs.main([str(stale)]) == 0
    assert settings_docs.main([str(stale), "--check"]) == 0


def test_settings_docs_name_every_key_and_rule():
    text = settings_docs.default_output().read_text()
    for key in (
        "`schedule.batch_size` | `int` | `2` | >= 1 |",
        "`lora.dropout` | `float` | `0.0` | in [0, 1)",
    ):
        assert key in text
    assert "| `tunelab.training.adamw` | `lr` | `float` | finite, > 0 |" in text
