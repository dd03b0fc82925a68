"""``tunelab cp``: copy a built-in recipe or config to customize it."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from tunelab.cli._discovery import builtin_recipes
from tunelab.config import builtin_configs
from tunelab.errors import TunelabError


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the ``cp`` subcommand."""
    parser = subparsers.add_parser(
        "cp",
        parents=[parent],
        help="copy a built-in recipe or config",
        description="Copy a built-in recipe (e.g. lora_finetune_distributed) or config "
        "(e.g. tiny/lora) to DEST. DEST without a suffix gets .py or .yaml; an existing "
        "folder receives the file under its own name.",
    )
    parser.add_argument("name", metavar="NAME", help="built-in recipe or config name")
    parser.add_argument("dest", metavar="DEST", type=Path, help="file or folder to copy to")
    parser.add_argument("--force", action="store_true", help="overwrite DEST if it exists")


def run(namespace: argparse.Namespace) -> int:
    """Copy the named recipe or config.

    Args:
        namespace: The parsed arguments: ``name``, ``dest``, ``force``.

    Returns:
        The exit code, 0.

    Raises:
        TunelabError: If the name is unknown or DEST exists without ``--force``.
    """
    recipes, configs = builtin_recipes(), builtin_configs()
    if namespace.name in recipes:
        source, suffix = recipes[namespace.name], ".py"
    elif namespace.name in configs:
        source, suffix = configs[namespace.name], ".yaml"
    else:
        raise TunelabError(
            f"no built-in recipe or config named '{namespace.name}' (`tunelab ls` lists them)"
        )
    dest: Path = namespace.dest
    if dest.is_dir():
        dest = dest / source.name
    elif not dest.suffix:
        dest = dest.with_suffix(suffix)
    if dest.exists() and not namespace.force:
        raise TunelabError(f"{dest} already exists; pass --force to overwrite it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, dest)
    print(f"Copied {namespace.name} to {dest}")
    return 0
