"""Every recipe setting has a one-line docstring; every shipped config validates."""

import dataclasses
import importlib
import pkgutil
import typing

import pytest

import tunelab.config
from tunelab.cli import builtin_recipes, load_recipe_args
from tunelab.cli._check import check_config
from tunelab.config import RecipeArgs, builtin_configs, field_docs


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


@pytest.mark.skipif(not SHIPPED, reason="configs/ holds no YAML files yet")
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_validates_against_its_recipe(name):
    config_path, recipe_path = check_config(name, [])
    assert config_path == SHIPPED[name]
    assert recipe_path.is_file()
