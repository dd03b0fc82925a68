"""The ``tunelab`` command line: ``ls``, ``cp``, ``validate``, ``run``, ``download``.

Recipes and configs are found by scanning the built-in folders, never from a hand list.
"""

import os as _os
import sys as _sys


def _hand_over_to_a_launch_server() -> None:
    """In the ``tunelab`` script with ``TUNELAB_LAUNCH_SERVER`` set: let the server run it.

    Runs before the command's heavy imports; ``worker_client`` is loaded by path (the standard
    library only, not ``tunelab.lifecycle``'s package). Returns when the server does not run
    this command (see ``tunelab.cli.launch_server``); a program that imports ``tunelab.cli``
    is never handed over.
    """
    main_file = getattr(_sys.modules.get("__main__"), "__file__", None) or ""
    if not _os.environ.get("TUNELAB_LAUNCH_SERVER") or _os.path.basename(main_file) != "tunelab":
        return
    import importlib.util

    client = _os.path.join(_os.path.dirname(_os.path.dirname(__file__)), "lifecycle")
    spec = importlib.util.spec_from_file_location(
        "tunelab_worker_client", _os.path.join(client, "worker_client.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.hand_over_launch()


_hand_over_to_a_launch_server()

from tunelab.cli._discovery import builtin_recipes, load_recipe_args  # noqa: E402 - after it
from tunelab.cli.main import main  # noqa: E402

__all__ = ["builtin_recipes", "load_recipe_args", "main"]
