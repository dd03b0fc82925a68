"""Pluggable metric loggers: stdout, JSONL, TensorBoard, Weights & Biases.

Recipes build a list of them from ``metric_loggers`` in the config and call them on rank 0
only. Each logger takes ``log(metrics, step)`` and ``close()``.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any, Protocol

from tunelab.errors import ConfigError, first_line
from tunelab.lifecycle.run_folder import trim_step_records


class MetricLogger(Protocol):
    """What a recipe needs from a metric logger."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record one step's metrics."""

    def close(self) -> None:
        """Flush and release resources."""


class StdoutLogger:
    """One line per logged step on standard output."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Print ``step N | name value ...``."""
        parts = " | ".join(f"{name} {_format(value)}" for name, value in metrics.items())
        print(f"step {step} | {parts}", file=sys.stdout, flush=True)

    def close(self) -> None:
        """Nothing to release."""


class JsonlLogger:
    """Appends one JSON object per logged step to ``{log_dir}/metrics.jsonl``.

    The file is opened for each record and closed after it, so no handle outlives a trim of
    the file at a resume (``RunFolder.trim_step_logs`` rewrites ``logs/metrics.jsonl``).

    Args:
        log_dir: Folder for the file (the recipe passes ``{output_dir}/logs``).
        filename: Name of the file inside ``log_dir``.
    """

    def __init__(self, log_dir: str, filename: str = "metrics.jsonl") -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(log_dir) / filename

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Append ``{"step": step, **metrics}`` as one line (written through at once)."""
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps({"step": step, **metrics}) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step``: a resumed run logs them again.

        The same trim as every per-step log of a run folder's ``logs/`` gets
        (:func:`tunelab.lifecycle.run_folder.trim_step_records`); here for a file named anywhere.
        Lines that are not JSON records (a line cut short by a crash) are dropped too.
        """
        trim_step_records(self.path, step)

    def close(self) -> None:
        """Nothing to release: each record is written and closed as it is logged."""


class TensorBoardLogger:
    """Scalars to TensorBoard event files in ``log_dir`` (needs ``tensorboard``).

    Each step's scalars are flushed as they are logged, so a crash loses none. After a resume,
    :meth:`truncate_after` makes TensorBoard drop the steps that are logged again.

    Args:
        log_dir: Folder for the event files.

    Raises:
        ConfigError: ``tensorboard`` is not installed.
    """

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ConfigError(
                "metric logger TensorBoardLogger needs tensorboard: pip install tensorboard"
            ) from error
        self._summary_writer = SummaryWriter
        self.log_dir = log_dir
        self._writer: Any = None  # opened on first use: a resume opens it with a purge step

    def _open(self, purge_step: int | None = None) -> Any:
        if self._writer is not None:
            self._writer.close()
        self._writer = self._summary_writer(log_dir=self.log_dir, purge_step=purge_step)
        return self._writer

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Add each metric as a scalar at ``step`` and flush."""
        writer = self._writer or self._open()
        for name, value in metrics.items():
            writer.add_scalar(name, value, step)
        writer.flush()

    def truncate_after(self, step: int) -> None:
        """Hide records of steps after ``step`` from TensorBoard: a resumed run logs them again.

        The event files are append-only; a start marker at ``step + 1`` tells TensorBoard's
        reader to drop the older events from that step on.
        """
        self._open(purge_step=step + 1)

    def close(self) -> None:
        """Flush and close the writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandBLogger:
    """Weights & Biases run (needs ``wandb``; honours ``WANDB_MODE=offline``).

    A resumed training run starts a new W&B run, which logs from the resumed step on.

    Args:
        project: The W&B project.
        log_dir: Local folder for W&B files (``WANDB_DIR`` or the working directory if None).
        **init_kwargs: Passed to ``wandb.init`` (entity, name, tags, ...).

    Raises:
        ConfigError: ``wandb`` is not installed, or it cannot start a run (no API key while
            online, say).
    """

    def __init__(self, project: str = "tunelab", log_dir: str | None = None, **init_kwargs: Any):
        try:
            import wandb
        except ImportError as error:
            raise ConfigError("metric logger WandBLogger needs wandb: pip install wandb") from error
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
        try:
            self._run = wandb.init(project=project, dir=log_dir, **init_kwargs)
        except wandb.errors.Error as error:
            # Its message spans lines and names no fix for a run without a terminal.
            raise ConfigError(
                f"metric logger WandBLogger cannot start a run: {first_line(error)} "
                "(log in with `wandb login` or WANDB_API_KEY, or set WANDB_MODE=offline)"
            ) from error

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log the metrics at ``step`` (several calls with one step make one W&B row)."""
        self._run.log(metrics, step=step)

    def close(self) -> None:
        """Finish the run (in offline mode its files stay in ``log_dir`` for ``wandb sync``)."""
        import wandb

        self._run.finish()
        # wandb 0.31's finish can return before its service process has written the run file
        # (measured: 1 run in 6 held only the file header); teardown waits for the service.
        wandb.teardown()


def _format(value: float) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
