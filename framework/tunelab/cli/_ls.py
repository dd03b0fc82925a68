"""``tunelab ls``: the built-in recipes and the configs that go with each."""

from __future__ import annotations

import argparse

from tunelab.cli._discovery import builtin_recipes, configs_by_recipe


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the ``ls`` subcommand."""
    subparsers.add_parser(
        "ls",
        parents=[parent],
        help="list the built-in recipes and their configs",
        description="List the built-in recipes and, for each, the built-in configs whose "
        "`recipe:` key names it.",
    )


def run(namespace: argparse.Namespace) -> int:
    """Print the recipes and their configs as two columns.

    Args:
        namespace: The parsed arguments (none are used).

    Returns:
        The exit code, 0.
    """
    recipes = builtin_recipes()
    groups = configs_by_recipe()
    rows: list[tuple[str, str]] = []
    for recipe in recipes:
        configs = groups.get(recipe) or ["-"]
        rows.extend((recipe if index == 0 else "", config) for index, config in enumerate(configs))
    # Configs naming no built-in recipe are still worth listing: they point at a recipe path.
    orphans = [c for name, configs in groups.items() if name not in recipes for c in configs]
    if orphans:
        rows.extend(("(other)" if index == 0 else "", c) for index, c in enumerate(orphans))
    width = max([len("RECIPE")] + [len(recipe) for recipe, _ in rows]) + 3
    print(f"{'RECIPE':<{width}}CONFIG")
    for recipe, config in rows:
        print(f"{recipe:<{width}}{config}")
    return 0
