"""Benchmarks with EleutherAI's lm-evaluation-harness on tunelab's own model.

:class:`TunelabLM` is lm-eval's ``LM`` on a tunelab model and tokenizer (log-likelihoods
through the chunked output layer at the continuation's positions only, generation with the
KV cache); :func:`evaluate` runs tasks by registry name or task YAML file/folder, split over
the ranks of the process group; :func:`results_table` prints the scores. Needs the ``eval``
extra (``pip install 'tunelab[eval]'``). See docs/eval.md.
"""

from tunelab.eval.lm import TunelabLM
from tunelab.eval.tasks import evaluate, resolve_tasks, results_table

__all__ = ["TunelabLM", "evaluate", "resolve_tasks", "results_table"]
