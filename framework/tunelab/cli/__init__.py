"""The ``tunelab`` command line: ``ls``, ``cp``, ``validate``, ``run``, ``download``.

Recipes and configs are found by scanning the built-in folders, never from a hand list.
"""

import os as _os
import sys as _sys

if (
    _os.environ.get("TUNELAB_LAUNCH_SERVER")
    and _os.path.basename(getattr(_sys.modules.get("__main__"), "__file__", None) or "")
    == "tunelab"
):  # The `tunelab` command itself, before its heavy imports: see launch_server.py.
    import importlib.util as _util

    _spec = _util.spec_from_file_location(
        "tunelab_worker_client",
        _os.path.join(
            _os.path.dirname(_os.path.dirname(__file__)), "lifecycle", "worker_client.py"
        ),
    )
    _client = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_client)
    _client.hand_over_launch()  # Returns when the server does not run this command.

from tunelab.cli._discovery import builtin_recipes, load_recipe_args
from tunelab.cli.main import main

__all__ = ["builtin_recipes", "load_recipe_args", "main"]
