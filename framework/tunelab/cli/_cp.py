"""``tunelab cp``: copy a built-in recipe or config to customize it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tunelab.cli._discovery import builtin_recipes, suggest_builtin
from tunelab.config import builtin_configs
from tunelab.errors import TunelabError
from tunelab.formats.layout import write_atomic


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the ``cp`` subcommand."""
    parser = subparsers.add_parser(
        "cp",
        parents=[parent],
        help="copy a built-in recipe or config",
        description="Copy a built-in recipe (e.g. lora_finetune_distributed) or config "
        "(e.g. tiny/lora) to DEST. A new DEST without a suffix gets .py or .yaml; an existing "
        "folder receives the file under its own name; '-' prints the file.",
    )
    parser.add_argument("name", metavar="NAME", help="built-in recipe or config name")
    parser.add_argument(
        "dest", metavar="DEST", type=Path, help="file or folder to copy to; - for stdout"
    )
    parser.add_argument("--force", action="store_true", help="overwrite DEST if it exists")


def _destination(dest: Path, source: Path, suffix: str) -> Path:
    """Where the copy goes: into a folder, as given, or with the suffix added to a new name."""
    if dest.is_dir():
        return dest / source.name
    if dest.exists() or dest.is_symlink() or dest.suffix:
        # An existing file, a device such as /dev/stdout, or a name with a suffix: as given.
        return dest
    return dest.with_suffix(suffix)


def run(namespace: argparse.Namespace) -> int:
    """Copy the named recipe or config.

    Args:
        namespace: The parsed arguments: ``name``, ``dest``, ``force``.

    Returns:
        The exit code, 0.

    Raises:
        TunelabError: If the name is unknown or DEST is an existing file and not ``--force``.
    """
    recipes, configs = builtin_recipes(), builtin_configs()
    if namespace.name in recipes:
        source, suffix = recipes[namespace.name], ".py"
    elif namespace.name in configs:
        source, suffix = configs[namespace.name], ".yaml"
    else:
        hint = suggest_builtin(namespace.name) or " (`tunelab ls` lists them)"
        raise TunelabError(f"no built-in recipe or config named '{namespace.name}'{hint}")
    if str(namespace.dest) == "-":
        sys.stdout.buffer.write(source.read_bytes())
        sys.stdout.flush()
        return 0
    dest = _destination(namespace.dest, source, suffix)
    if dest.exists() and not dest.is_file():
        # A device or pipe (/dev/stdout, /dev/null, a FIFO): write to it; it is not "a file
        # that already exists", and copyfile refuses pipes.
        with open(dest, "wb") as stream:
            stream.write(source.read_bytes())
        return 0
    if dest.exists() and not namespace.force:
        raise TunelabError(f"{dest} already exists; pass --force to overwrite it")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Whole or not at all: a failed write (a full disk, `ulimit -f`) leaves no part of the
        # copy, and `--force` keeps the file it would have replaced.
        write_atomic(dest, source.read_bytes(), sync=False)
    except OSError as err:
        raise TunelabError(
            f"cannot copy {namespace.name} to {dest}: {err.strerror or err}"
        ) from err
    print(f"Copied {namespace.name} to {dest}")
    return 0
