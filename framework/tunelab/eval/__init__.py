"""Benchmarks with EleutherAI's lm-evaluation-harness on tunelab's own model.

:class:`TunelabLM` is lm-eval's ``LM`` on a tunelab model and tokenizer (log-likelihoods
through the chunked output layer at the continuation's positions only, generation with the
KV cache); :func:`evaluate` runs tasks by registry name or task YAML file/folder, split over
the ranks of the process group; :func:`results_table` prints the scores. :class:`TrainingEval`
runs tasks on the live model during training (the training recipes' ``eval.*`` settings),
with :func:`task_metrics` naming the scores ``eval/<task>/<metric>``. Needs the ``eval``
extra (``pip install 'tunelab[eval]'``). See docs/eval.md.

``TrainingEval`` and ``task_metrics`` import without lm-eval (a training run without
``eval.tasks`` does not need it); the other names import lm-eval when first used, and without
it that is one error saying how to install it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tunelab.eval.during_training import TrainingEval, task_metrics

if TYPE_CHECKING:
    from tunelab.eval.lm import TunelabLM
    from tunelab.eval.tasks import evaluate, resolve_tasks, results_table

__all__ = [
    "TrainingEval",
    "TunelabLM",
    "evaluate",
    "resolve_tasks",
    "results_table",
    "task_metrics",
]

# The names that need lm-eval, and the module each lives in (imported on first use).
_NEEDS_LM_EVAL = {
    "TunelabLM": "tunelab.eval.lm",
    "evaluate": "tunelab.eval.tasks",
    "resolve_tasks": "tunelab.eval.tasks",
    "results_table": "tunelab.eval.tasks",
}


def __getattr__(name: str) -> Any:
    if name in _NEEDS_LM_EVAL:
        return getattr(importlib.import_module(_NEEDS_LM_EVAL[name]), name)
    raise AttributeError(f"module 'tunelab.eval' has no attribute {name!r}")
