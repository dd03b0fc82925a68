"""The ``tunelab`` command line: ``ls``, ``cp``, ``validate``, ``run``, ``download``.

Recipes and configs are found by scanning the built-in folders, never from a hand list.
"""

from tunelab.cli._discovery import builtin_recipes, load_recipe_args
from tunelab.cli.main import main

__all__ = ["builtin_recipes", "load_recipe_args", "main"]
