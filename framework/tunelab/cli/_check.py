"""Load a config and validate it against its recipe: shared by ``validate`` and ``run``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig

from tunelab.cli._data_check import check_json_rows
from tunelab.cli._discovery import load_recipe_args, resolve_recipe
from tunelab.config import load_config, parse_args, resolve_config_path
from tunelab.config._renamed import rename_notice
from tunelab.errors import ConfigError, TunelabError
from tunelab.lifecycle import RunFolder

_SAID: set[tuple[str, str]] = set()
"""The old flat keys this process has already named (``tunelab: old -> new``)."""


def recipe_of_config(cfg: DictConfig, config_path: Path) -> Path:
    """Return the recipe script a config's ``recipe`` key names.

    Args:
        cfg: The loaded config.
        config_path: Its file; a relative recipe path may be relative to its folder.

    Returns:
        The recipe script.

    Raises:
        ConfigError: If the config has no string ``recipe`` key.
        TunelabError: If the recipe it names does not exist.
    """
    recipe = cfg.get("recipe")
    if not isinstance(recipe, str) or not recipe:
        raise ConfigError(
            f"config {config_path} has no 'recipe' key: add `recipe: <name or path>` naming "
            "the recipe it belongs to"
        )
    try:
        return resolve_recipe(recipe, relative_to=config_path.parent)
    except TunelabError as err:
        raise ConfigError(f"config {config_path}, key 'recipe': {err}") from err


def load_recipe_config(
    config: str, overrides: Sequence[str], recipe: str | None = None
) -> tuple[DictConfig, Path, Path | None]:
    """Load a config with overrides typed by its recipe's settings (text taken literally).

    Args:
        config: A built-in config name or a YAML path.
        overrides: ``key=value`` / ``~key`` strings.
        recipe: The recipe (name or path); None takes the config's ``recipe`` key (or a
            ``recipe=`` override).

    Old flat keys (``batch_size``) move to their sections (``schedule.batch_size``), each said
    once on stderr in one line.

    Returns:
        The config, its file, and the recipe script (None when the config names none that
        exists: validation then says so).
    """
    config_path = resolve_config_path(config)
    if recipe is None:
        recipe = load_config(str(config_path)).get("recipe")
        for override in overrides:
            key, sep, text = override.partition("=")
            if sep and key == "recipe":
                recipe = text
    recipe_path = args_cls = None
    if isinstance(recipe, str) and recipe:
        try:
            recipe_path = resolve_recipe(recipe, relative_to=config_path.parent)
            args_cls = load_recipe_args(recipe_path)
        except TunelabError:
            recipe_path = args_cls = None  # check_config names the problem with the recipe.
    renamed: list[tuple[str, str]] = []
    cfg = load_config(str(config_path), overrides, args_cls, renamed)
    for old, new in renamed:
        # One line per old key, once per command (run loads the config more than once), here
        # in the launcher only: the workers map the same keys silently.
        if (old, new) not in _SAID:
            _SAID.add((old, new))
            print(rename_notice(old, new), file=sys.stderr, flush=True)
    return cfg, config_path, recipe_path


def check_config(
    config: str, overrides: Sequence[str], recipe: str | None = None
) -> tuple[Path, Path]:
    """Load a config with overrides and validate it against a recipe's ``ARGS``.

    Args:
        config: A built-in config name or a YAML path.
        overrides: ``key=value`` / ``~key`` strings.
        recipe: The recipe (name or path); None takes the config's ``recipe`` key.

    Returns:
        The config file and the recipe script.

    Raises:
        TunelabError: If anything is missing or the config does not validate.
    """
    if recipe:
        resolve_recipe(recipe)  # A recipe given by name must exist: said here, plainly.
    cfg, config_path, recipe_path = load_recipe_config(config, overrides, recipe)
    if recipe_path is None:
        recipe_path = recipe_of_config(cfg, config_path)
    args = parse_args(cfg, load_recipe_args(recipe_path))
    resume = getattr(getattr(args, "checkpoint", None), "resume_from_checkpoint", None)
    output_dir = getattr(args, "output_dir", None)
    if resume is not None and isinstance(output_dir, str) and output_dir:
        # What the recipe would refuse at start, said before any process starts: another run
        # holding the folder first, then what the folder holds.
        may_exist = bool(getattr(args, "output_dir_may_exist", True))
        RunFolder(output_dir).check_before_start(resume, may_exist=may_exist)
    check_json_rows(args)  # A broken row of local JSON data, before any worker starts.
    return config_path, recipe_path
