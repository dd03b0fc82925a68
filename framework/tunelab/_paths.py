"""Where the built-in recipes, configs and embedded assets live, and path suggestions.

In a checkout they are the top-level ``recipes/`` and ``configs/`` folders; an installed wheel
carries them as ``tunelab/_builtin/recipes`` and ``tunelab/_builtin/configs``.
"""

import difflib
import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def _builtin_dir(name: str) -> Path:
    packaged = _PACKAGE_DIR / "_builtin" / name
    if packaged.is_dir():
        return packaged
    return _PACKAGE_DIR.parents[1] / name


def recipes_dir() -> Path:
    """Return the folder holding the built-in recipe scripts."""
    return _builtin_dir("recipes")


def configs_dir() -> Path:
    """Return the folder holding the built-in YAML configs."""
    return _builtin_dir("configs")


def assets_dir() -> Path:
    """Return the folder holding the embedded tiny model, tokenizer and datasets."""
    return _PACKAGE_DIR / "assets"


_YAML_SUFFIXES = (".yaml", ".yml")


def builtin_configs() -> dict[str, Path]:
    """Return the built-in configs, found by scanning ``configs_dir()`` recursively.

    Returns:
        A mapping from config name (the path relative to ``configs_dir()`` without its
        suffix, ``/``-separated, e.g. ``tiny/lora``) to the YAML file, sorted by name.
    """
    root = configs_dir()
    if not root.is_dir():
        return {}
    found = {}
    for path in root.rglob("*"):
        if path.suffix in _YAML_SUFFIXES and path.is_file():
            found[path.relative_to(root).with_suffix("").as_posix()] = path
    return dict(sorted(found.items()))


def suggest_path(path: str | os.PathLike) -> str | None:
    """Return the path with its first missing part replaced by the closest existing name.

    ``data/sft.jsnol`` gives ``data/sft.jsonl`` when that file exists; None when nothing close
    exists, or the path exists.

    Args:
        path: A path that may not exist.

    Returns:
        The corrected path as a string, or None.
    """
    path = Path(path).expanduser()
    parts = path.parts
    for index in range(1, len(parts) + 1):
        here = Path(*parts[:index])
        if here.exists():
            continue
        parent = Path(*parts[: index - 1]) if index > 1 else Path(".")
        try:
            names = [entry.name for entry in os.scandir(parent)]
        except OSError:
            return None
        close = difflib.get_close_matches(parts[index - 1], names, n=1, cutoff=0.6)
        if not close:
            return None
        fixed = Path(*parts[: index - 1], close[0], *parts[index:])
        return str(fixed) if fixed.exists() else None
    return None
