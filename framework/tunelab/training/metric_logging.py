"""Pluggable metric loggers: stdout, JSONL, TensorBoard, Weights & Biases.

Recipes build a list of them from ``metric_loggers`` in the config and call them on rank 0
only. Each logger takes ``log(metrics, step)`` and ``close()``.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any, Protocol

from tunelab.errors import ConfigError


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

    Args:
        log_dir: Folder for the file (the recipe passes ``{output_dir}/logs``).
        filename: Name of the file inside ``log_dir``.
    """

    def __init__(self, log_dir: str, filename: str = "metrics.jsonl") -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(log_dir) / filename
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Write ``{"step": step, **metrics}`` as one line and flush it."""
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step``: a resumed run logs them again.

        Lines that are not JSON records (a line cut short by a crash) are dropped too.
        """
        self._file.close()
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line + "\n")
        temp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        temp.write_text("".join(kept), encoding="utf-8")
        os.replace(temp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def close(self) -> None:
        """Close the file."""
        self._file.close()


class TensorBoardLogger:
    """Scalars to TensorBoard event files in ``log_dir`` (needs ``tensorboard``).

    Args:
        log_dir: Folder for the event files.
    """

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ConfigError(
                "metric logger TensorBoardLogger needs tensorboard: pip install tensorboard"
            ) from error
        self._writer = SummaryWriter(log_dir=log_dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Add each metric as a scalar."""
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        """Flush and close the writer."""
        self._writer.close()


class WandBLogger:
    """Weights & Biases run (needs ``wandb``; honours ``WANDB_MODE=offline``).

    Args:
        project: The W&B project.
        log_dir: Local folder for W&B files.
        **init_kwargs: Passed to ``wandb.init`` (entity, name, tags, ...).
    """

    def __init__(self, project: str = "tunelab", log_dir: str | None = None, **init_kwargs: Any):
        try:
            import wandb
        except ImportError as error:
            raise ConfigError("metric logger WandBLogger needs wandb: pip install wandb") from error
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
        self._run = wandb.init(project=project, dir=log_dir, **init_kwargs)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log the metrics at ``step``."""
        self._run.log(metrics, step=step)

    def close(self) -> None:
        """Finish the run."""
        self._run.finish()


def _format(value: float) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
