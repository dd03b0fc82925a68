"""Find built-in recipes and configs by scanning, and read a recipe's ``ARGS`` without running it."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
import sys
from pathlib import Path

import yaml

from tunelab import _paths
from tunelab.config import RecipeArgs, builtin_configs
from tunelab.errors import ConfigError, TunelabError


def builtin_recipes() -> dict[str, Path]:
    """Return the built-in recipes: every ``*.py`` in ``recipes_dir()`` not starting with ``_``.

    Returns:
        A mapping from recipe name (the file stem) to its path, sorted by name.
    """
    root = _paths.recipes_dir()
    if not root.is_dir():
        return {}
    return {
        path.stem: path
        for path in sorted(root.glob("*.py"))
        if not path.name.startswith("_") and path.is_file()
    }


def resolve_recipe(recipe: str, relative_to: Path | None = None) -> Path:
    """Find the script a recipe argument names.

    Args:
        recipe: A built-in recipe name or a path to a ``.py`` file.
        relative_to: Another folder to look in for a relative path (e.g. the config's folder).

    Returns:
        The path of the recipe script.

    Raises:
        TunelabError: If there is no such file and no such built-in recipe.
    """
    builtins = builtin_recipes()
    if recipe in builtins:
        return builtins[recipe]
    path = Path(recipe).expanduser()
    candidates = (
        [path] if path.is_absolute() else [path, *([relative_to / path] if relative_to else [])]
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if path.suffix == ".py" or "/" in recipe:
        raise TunelabError(f"recipe file not found: {recipe}")
    message = f"unknown recipe '{recipe}': not a .py file and not a built-in recipe"
    close = difflib.get_close_matches(recipe, list(builtins), n=1)
    message += f"; did you mean '{close[0]}'?" if close else " (`tunelab ls` lists them)"
    raise TunelabError(message)


def load_recipe_args(recipe_path: Path) -> type[RecipeArgs]:
    """Import a recipe script without running it and return its module-level ``ARGS``.

    Recipes guard their entry point with ``if __name__ == "__main__":``, so importing under
    another name runs only their definitions.

    Args:
        recipe_path: The recipe script.

    Returns:
        The recipe's ``RecipeArgs`` subclass.

    Raises:
        TunelabError: If the script has a syntax error or no ``ARGS`` dataclass.
    """
    name = "_tunelab_recipe_" + re.sub(r"\W", "_", recipe_path.stem)
    spec = importlib.util.spec_from_file_location(name, recipe_path)
    if spec is None or spec.loader is None:
        raise TunelabError(f"cannot load recipe {recipe_path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # Registered so dataclasses and inspect.getsource can find the module by name.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        raise TunelabError(
            f"recipe {recipe_path}, line {err.lineno}: syntax error: {err.msg}"
        ) from err
    except ImportError as err:
        raise TunelabError(f"cannot import recipe {recipe_path}: {err}") from err
    args_cls = getattr(module, "ARGS", None)
    if not (
        isinstance(args_cls, type)
        and dataclasses.is_dataclass(args_cls)
        and issubclass(args_cls, RecipeArgs)
    ):
        raise ConfigError(
            f"recipe {recipe_path} has no module-level ARGS: set ARGS = <its RecipeArgs subclass>"
        )
    return args_cls


def config_recipe_name(config_path: Path) -> str | None:
    """Return the ``recipe`` key of a YAML config, or None if it has none or does not parse."""
    try:
        data = yaml.safe_load(config_path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    recipe = data.get("recipe") if isinstance(data, dict) else None
    return recipe if isinstance(recipe, str) else None


def configs_by_recipe() -> dict[str | None, list[str]]:
    """Group the built-in configs by the recipe their ``recipe`` key names.

    Returns:
        A mapping from recipe name (None for configs without one) to config names.
    """
    groups: dict[str | None, list[str]] = {}
    for config_name, path in builtin_configs().items():
        groups.setdefault(config_recipe_name(path), []).append(config_name)
    return groups
