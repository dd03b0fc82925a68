"""Find built-in recipes and configs by scanning, and read a recipe's ``ARGS`` without running it."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import yaml

from tunelab import _paths
from tunelab._paths import suggest_path
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
    configs = builtin_configs()
    if recipe in configs:
        owner = config_recipe_name(configs[recipe]) or "RECIPE"
        raise TunelabError(
            f"'{recipe}' is a config, not a recipe: `tunelab run {owner} --config {recipe}`"
        )
    close = difflib.get_close_matches(recipe, list(builtins), n=1)
    if path.suffix == ".py" or "/" in recipe:
        message = f"recipe file not found: {recipe}"
        near = suggest_path(path) or (close[0] if close else None)
        raise TunelabError(message + (f"; did you mean '{near}'?" if near else ""))
    message = f"unknown recipe '{recipe}': not a .py file and not a built-in recipe"
    message += f"; did you mean '{close[0]}'?" if close else " (`tunelab ls` lists them)"
    raise TunelabError(message)


def suggest_builtin(name: str) -> str:
    """Return ``"; did you mean 'X'?"`` for the closest built-in recipe or config, or ''."""
    close = difflib.get_close_matches(name, [*builtin_recipes(), *builtin_configs()], n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


# Modules a recipe may take its ARGS from without the recipe being imported: they hold only
# settings dataclasses and import no torch (a unit test checks that).
_SETTINGS_PACKAGE = "tunelab.config"


def _args_source(tree: ast.Module) -> tuple[str, str] | None:
    """Return ``(module, name)`` when ``ARGS`` is a class imported from tunelab.config.

    Only the plain shape counts: one top-level ``ARGS = Name`` (or ``ARGS = alias.Name``) whose
    name comes from a top-level ``from tunelab.config... import Name`` (or ``import ... as``).
    """
    stores = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and node.id == "ARGS" and isinstance(node.ctx, ast.Store)
    ]
    top_level = [
        statement
        for statement in tree.body
        if isinstance(statement, ast.Assign)
        and [ast.unparse(target) for target in statement.targets] == ["ARGS"]
        or isinstance(statement, ast.AnnAssign)
        and ast.unparse(statement.target) == "ARGS"
    ]
    # Set once, at the top: any other assignment could change it at import time.
    if len(stores) != 1 or len(top_level) != 1 or top_level[0].value is None:
        return None
    value = top_level[0].value
    imported: dict[str, tuple[str, str]] = {}  # local name -> (module, name); name "" = module
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
            for alias in statement.names:
                imported[alias.asname or alias.name] = (statement.module, alias.name)
        elif isinstance(statement, ast.Import):
            for alias in statement.names:
                if alias.asname:
                    imported[alias.asname] = (alias.name, "")
    if isinstance(value, ast.Name) and value.id in imported:
        module, name = imported[value.id]
    elif (
        isinstance(value, ast.Attribute)
        and isinstance(value.value, ast.Name)
        and imported.get(value.value.id, ("", "x"))[1] == ""
    ):
        module, name = imported[value.value.id][0], value.attr
    else:
        return None
    if not name or not (module == _SETTINGS_PACKAGE or module.startswith(_SETTINGS_PACKAGE + ".")):
        return None
    return module, name


def _args_without_import(recipe_path: Path) -> object | None:
    """Find a recipe's ARGS from its source, importing only tunelab.config; None if unsure."""
    try:
        tree = ast.parse(recipe_path.read_text(encoding="utf-8"), str(recipe_path))
    except (OSError, UnicodeDecodeError, SyntaxError):
        return None  # The import below reports it properly.
    source = _args_source(tree)
    if source is None:
        return None
    try:
        module = importlib.import_module(source[0])
    except ImportError:
        return None
    return getattr(module, source[1], None)


def _import_recipe(recipe_path: Path) -> ModuleType:
    name = "_tunelab_recipe_" + re.sub(r"\W", "_", recipe_path.stem)
    spec = importlib.util.spec_from_file_location(name, recipe_path)
    if spec is None or spec.loader is None:
        raise TunelabError(f"cannot load recipe {recipe_path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # Registered so dataclasses and inspect.getsource can find the module by name.
    sys.modules[name] = module
    # A script sees its own folder on sys.path when it runs, so a copied recipe may import a
    # helper next to it; importing it here must see the same.
    folder = str(recipe_path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        raise TunelabError(
            f"recipe {recipe_path}, line {err.lineno}: syntax error: {err.msg}"
        ) from err
    except ImportError as err:
        raise TunelabError(f"cannot import recipe {recipe_path}: {err}") from err
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module


def load_recipe_args(recipe_path: Path) -> type[RecipeArgs]:
    """Return a recipe script's module-level ``ARGS`` without running the recipe.

    When the script takes ``ARGS`` straight from ``tunelab.config`` (``from
    tunelab.config.recipe_args import LoRAFinetuneArgs`` and ``ARGS = LoRAFinetuneArgs``), it is
    read from the source and only that module is imported: the recipe's own imports pull in
    torch, which takes longer than the whole check. Otherwise (a copied recipe with its own
    ``RecipeArgs``) the script is imported under another name; recipes guard their entry point
    with ``if __name__ == "__main__":``, so that runs only their definitions.

    Args:
        recipe_path: The recipe script.

    Returns:
        The recipe's ``RecipeArgs`` subclass.

    Raises:
        TunelabError: If the script has a syntax error or no ``ARGS`` dataclass.
    """
    args_cls = _args_without_import(recipe_path)
    if args_cls is None:
        args_cls = getattr(_import_recipe(recipe_path), "ARGS", None)
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
