"""Where the built-in recipes, configs and embedded assets live.

In a checkout they are the top-level ``recipes/`` and ``configs/`` folders; an installed wheel
carries them as ``tunelab/_builtin/recipes`` and ``tunelab/_builtin/configs``.
"""

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
