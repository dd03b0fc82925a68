"""``tunelab verify``: check checkpoints and exports against the checksums in their manifests."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tunelab.errors import TunelabError
from tunelab.formats.integrity import MANIFEST_NAME, verify_folder

# step_N/, epoch_E/, and step_N_export/ (what tunelab export makes from step_N/).
_CHECKPOINT_NAME = re.compile(r"^(step|epoch)_\d+(_export)?$")


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the ``verify`` subcommand."""
    parser = subparsers.add_parser(
        "verify",
        parents=[parent],
        help="check step checkpoints and exports against their checksums",
        description="Check every file of a step checkpoint (step_N/), an export (epoch_E/, "
        "with its adapter/; step_N_export/) or of every checkpoint and export in an output_dir "
        "against the size and checksums in its tunelab_manifest.json. Prints one line per "
        "problem and exits 1 if there is any. Reads only JSON and file bytes; imports no torch.",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="step_N/, epoch_E/ or output_dir")


def _folders(path: Path) -> list[Path]:
    """The folders ``path`` stands for: itself if it has a manifest, else its checkpoints."""
    if not path.exists():
        raise TunelabError(f"{path} does not exist")
    if not path.is_dir():
        raise TunelabError(f"{path} is not a folder (give step_N/, epoch_E/ or an output_dir)")
    if (path / MANIFEST_NAME).is_file() or _CHECKPOINT_NAME.match(path.name):
        return [path]
    found = [child for child in path.iterdir() if _CHECKPOINT_NAME.match(child.name)]
    if not found:
        raise TunelabError(f"{path} holds no {MANIFEST_NAME}, step_N/ or epoch_E/ folder")
    return sorted(
        found,
        key=lambda child: (child.name.split("_")[0], int(child.name.split("_")[1]), child.name),
    )


def run(namespace: argparse.Namespace) -> int:
    """Verify each folder; print ``ok`` lines and one line per problem.

    Returns:
        0 when everything verifies, 1 otherwise.
    """
    bad = 0
    for path in [folder for given in namespace.paths for folder in _folders(Path(given))]:
        problems = verify_folder(path)
        if problems:
            bad += 1
            for problem in problems:
                print(f"FAILED {problem}")
        else:
            print(f"ok     {path}")
    return 1 if bad else 0
