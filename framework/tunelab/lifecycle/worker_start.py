"""How ``tunelab run`` starts a recipe: as ``python recipe.py`` would, with fewer collections.

A worker's imports (torch, DTensor, ``torch._dynamo``, tunelab) create some 300,000 objects that
live as long as the process. While they pile up, CPython's cyclic collector runs about 700
young, 63 middle and 5 full collections over them, which walk the growing heap again and
again. Measured on these 2-core machines (shared, load 8-13), the imports of
``lora_finetune_distributed`` took 3.61 CPU-s with the default thresholds and 3.42 with the
threshold below (means of 8 alternating pairs; 12 young collections, 1 middle, no full), in
every worker of every run; a 2-step ``tiny/lora`` launch on 2 processes, launcher included,
11.5 -> 11.2 CPU-s (4 pairs), on 1 process 4.60 -> 4.49 (6 pairs).

``tunelab run`` therefore starts each worker as ``python -c WORKER_CODE RECIPE ARGS``:
:data:`WORKER_CODE` raises the young generation's threshold (700 -> :data:`IMPORT_THRESHOLD`)
before anything is imported and runs the recipe file as ``__main__`` (:func:`run_recipe`: the
same ``sys.argv`` and ``sys.path[0]`` as ``python recipe.py``); ``recipe_main`` puts the
thresholds back (:func:`restore_collector`) once the recipe's imports are done, just before
it freezes the imported heap. The collector is never off: a recipe that does not call
``recipe_main`` only collects less often. About 1,400 unreachable objects of the imports
(of 335,000) are then frozen with the heap instead of freed.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys

IMPORT_THRESHOLD = 100_000
"""The young generation's collection threshold while a worker imports its recipe's modules."""

WORKER_CODE = (
    f"import gc; t = gc.get_threshold(); gc.set_threshold({IMPORT_THRESHOLD}, *t[1:]); "
    "from tunelab.lifecycle.worker_start import run_recipe; run_recipe(t)"
)
"""What ``python -c`` runs in each worker ``tunelab run`` starts (argv: recipe, its args)."""

_saved: list[tuple[int, ...]] = []


def worker_arguments(recipe: str, recipe_args: list[str]) -> list[str]:
    """The interpreter arguments that start ``recipe`` as a worker: ``-c WORKER_CODE ...``.

    Args:
        recipe: The recipe file's path.
        recipe_args: Its arguments (``--config CONFIG`` and overrides).

    Returns:
        The arguments after the Python executable.
    """
    return ["-c", WORKER_CODE, recipe, *recipe_args]


def run_recipe(thresholds: tuple[int, ...]) -> None:
    """Run the recipe file ``sys.argv[1]`` as ``__main__``, as ``python RECIPE ARGS`` would.

    Args:
        thresholds: The collector's thresholds before :data:`WORKER_CODE` raised them; put
            back by :func:`restore_collector`.
    """
    _saved[:] = [tuple(thresholds)]
    recipe = sys.argv[1]
    sys.argv = sys.argv[1:]
    # `python recipe.py` puts the recipe's folder first on the path (a copied recipe may
    # import modules beside it); `python -c` put the working directory there.
    sys.path[0] = os.path.dirname(os.path.abspath(recipe))
    runpy.run_path(recipe, run_name="__main__")


def restore_collector() -> None:
    """Put back the collector thresholds :func:`run_recipe` started with (a no-op otherwise)."""
    if _saved:
        gc.set_threshold(*_saved.pop())
