"""lm-eval benchmarks on the live model between training steps (the ``eval.*`` settings).

A training recipe builds a :class:`TrainingEval` before its first step and hands it to
``AfterStep``, which runs it at the steps it is due: every ``eval.every_n_steps`` and after
the last step (``eval.at_end``), after the step's metrics and validation and before its
export and checkpoint. All ranks take part (the sharded model all-gathers its parameters in
every forward); rank 0 gets lm-eval's results and returns them as metrics named
``eval/<task>/<metric>`` with ``eval/time_s``, the seconds the evaluation took.

An evaluation leaves training as it found it: the model goes back to train mode, its FSDP2
groups are resharded, and the random streams lm-eval seeds (Python, NumPy, torch CPU and
CUDA) are restored, so the losses are those of a run without it. Because a step's evaluation
is logged before the step's checkpoint is saved, a run resumed from that checkpoint does not
evaluate the step again, and one resumed from an earlier checkpoint drops the records after
it (the metric loggers' ``truncate_after``) and logs the step once more: every evaluated step
is logged exactly once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from torch import nn

from tunelab._rng import rng_state, set_rng_state
from tunelab.config.recipe_args import TrainingEvalArgs
from tunelab.data import Tokenizer
from tunelab.errors import ConfigError
from tunelab.eval import _collectives
from tunelab.training.reference import reshard_all

__all__ = ["TrainingEval", "task_metrics"]

logger = logging.getLogger(__name__)


class TrainingEval:
    """lm-eval tasks scored on the model being trained, at the steps ``settings`` names.

    With ``settings.tasks`` set, building it checks everything an evaluation needs, so a
    problem stops the run before its first step: lm-eval installed, every task known (a
    registry name or a task file or folder), every task's dataset loadable (a registry task
    whose data is not cached while the Hugging Face Hub cannot be reached is one error naming
    the task), and ``limit`` at least the number of processes. Without tasks it does nothing
    (:meth:`due` is always false) and needs no lm-eval.

    Args:
        settings: The ``eval`` settings (tasks, schedule, lm-eval options).
        model: The model being trained (plain or FSDP2-sharded, adapters on).
        tokenizer: Its tokenizer.

    Raises:
        ConfigError: lm-eval is missing, a task is unknown or its dataset cannot be loaded,
            or ``limit`` is below the number of processes.
    """

    def __init__(self, settings: TrainingEvalArgs, model: nn.Module, tokenizer: Tokenizer):
        self.settings = settings
        self.model = model
        self._lm: Any = None
        if not settings.tasks:
            return
        tensor_parallel = getattr(model, "tensor_parallel_mesh", None)
        if tensor_parallel is not None:
            # Its forwards pad rows to the tp size and its KV caches are not split by heads.
            raise ConfigError(
                f"key 'eval.tasks' with parallelism.tensor_parallel_size: "
                f"{tensor_parallel.size()} is not built yet: drop eval.tasks (evaluate the export)"
            )
        world_size = _collectives.world()[1]
        if settings.limit is not None and settings.limit < world_size:
            raise ConfigError(
                f"key 'eval.limit': {settings.limit} is below the {world_size} processes: every "
                "process needs at least one document of each task"
            )
        # Imported here: a run without eval.tasks needs no lm-eval.
        from tunelab.eval.lm import TunelabLM
        from tunelab.eval.tasks import check_datasets, resolve_tasks

        self._specs, self._manager = resolve_tasks(settings.tasks)
        check_datasets(self._specs, self._manager)
        self._lm = TunelabLM(
            model,
            tokenizer,
            batch_size=settings.batch_size,
            max_length=settings.max_length,
            max_gen_toks=settings.max_gen_toks,
            name="tunelab_training",
            seed=settings.seed,
        )

    @property
    def enabled(self) -> bool:
        """Whether there are tasks to evaluate."""
        return self._lm is not None

    def due(self, global_step: int, last_step: bool) -> bool:
        """Whether to evaluate after ``global_step``.

        Every ``every_n_steps`` steps and, with ``at_end``, after the run's last step.

        Args:
            global_step: Optimizer steps taken in the run, this one included.
            last_step: Whether this step ends the run.
        """
        if not self.enabled:
            return False
        every = self.settings.every_n_steps
        return bool(every and global_step % every == 0) or (last_step and self.settings.at_end)

    def __call__(self) -> dict[str, float]:
        """Evaluate the tasks on the model as it is now (every rank calls it).

        Returns:
            On rank 0 ``eval/<task>/<metric>`` for every score lm-eval reports and
            ``eval/time_s``; on the other ranks only ``eval/time_s``.

        Raises:
            ConfigError: A task's dataset can no longer be loaded.
        """
        from tunelab.eval.tasks import run_resolved

        start = time.perf_counter()
        model = self.model
        was_training = model.training
        saved_rng = (rng_state(), np.random.get_state())
        model.eval()  # no dropout while scoring
        try:
            results = run_resolved(
                self._lm,
                self._specs,
                self._manager,
                num_fewshot=self.settings.num_fewshot,
                limit=self.settings.limit,
                apply_chat_template=self.settings.apply_chat_template,
                log_samples=False,
                seed=self.settings.seed,
                # No standard errors: lm-eval bootstraps them in forked processes, and a fork
                # of this process (checkpoint and collective threads) can deadlock (seen).
                bootstrap_iters=0,
                quiet=True,
            )
        finally:
            model.train(was_training)
            # No-grad forwards leave the root's parameters gathered; the optimizer edits shards.
            reshard_all(model)
            # lm-eval seeds the global generators: give training back its own streams.
            set_rng_state(saved_rng[0])
            np.random.set_state(saved_rng[1])
        metrics = task_metrics(results) if results is not None else {}
        metrics["eval/time_s"] = time.perf_counter() - start
        if results is not None:
            scores = ", ".join(
                f"{name.removeprefix('eval/')} {value:.4g}"
                for name, value in metrics.items()
                if name != "eval/time_s"
            )
            logger.info("eval: %s (%.1f s)", scores, metrics["eval/time_s"])
        return metrics


def task_metrics(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's scores as flat metric names: ``eval/<task>/<metric>``.

    A metric of lm-eval's default filter (``none``) keeps its name (``acc``,
    ``exact_match``); one of another filter keeps lm-eval's ``<metric>,<filter>`` key (gsm8k's
    ``exact_match,strict-match``). Standard errors and values that are not numbers (lm-eval's
    ``N/A``) are left out; groups (mmlu) are listed like tasks.

    Args:
        results: What :func:`~tunelab.eval.evaluate` returns on rank 0.

    Returns:
        The scores, by name.
    """
    metrics: dict[str, float] = {}
    for task, scores in results.get("results", {}).items():
        for key, value in scores.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or "_stderr" in metric:
                continue  # alias, sample counts, standard errors
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name = metric if filter_name == "none" else key
            metrics[f"eval/{task}/{name}"] = float(value)
    return metrics
