"""``tunelab validate``: check a config against its recipe without running anything."""

from __future__ import annotations

import argparse

from tunelab.cli._check import check_config


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the ``validate`` subcommand."""
    parser = subparsers.add_parser(
        "validate",
        parents=[parent],
        help="check a config (and overrides) against its recipe",
        description="Load CONFIG with the overrides and check it strictly against the settings "
        "(ARGS) of the recipe its `recipe:` key names: unknown keys, types, the values each "
        "setting allows, that every _component_ exists and its arguments bind and follow its "
        "rules, and the files it names (model folder, tokenizer, dataset files, output_dir). "
        "Imports no torch and runs nothing.",
    )
    parser.add_argument("config", metavar="CONFIG", help="built-in config name or YAML path")
    parser.add_argument(
        "--recipe", help="validate against this recipe (name or path) instead of the config's"
    )
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="key=value or ~key")


def run(namespace: argparse.Namespace) -> int:
    """Validate and print ``OK: <config>``.

    Args:
        namespace: The parsed arguments: ``config``, ``recipe``, ``overrides``.

    Returns:
        The exit code, 0 (problems raise ``TunelabError``).
    """
    check_config(namespace.config, namespace.overrides, namespace.recipe)
    print(f"OK: {namespace.config}")
    return 0
