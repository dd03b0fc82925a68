"""Optimizers, LR schedules, metric loggers, progress bar and RNG state."""

from tunelab.training.lr_schedules import constant_schedule_with_warmup, cosine_schedule_with_warmup
from tunelab.training.metric_logging import (
    JsonlLogger,
    MetricLogger,
    StdoutLogger,
    TensorBoardLogger,
    WandBLogger,
)
from tunelab.training.optim import adamw
from tunelab.training.progress import ProgressBar
from tunelab.training.rng import rng_state, seed_everything, set_rng_state

__all__ = [
    "JsonlLogger",
    "MetricLogger",
    "ProgressBar",
    "StdoutLogger",
    "TensorBoardLogger",
    "WandBLogger",
    "adamw",
    "constant_schedule_with_warmup",
    "cosine_schedule_with_warmup",
    "rng_state",
    "seed_everything",
    "set_rng_state",
]
