"""Learning-rate schedules."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def cosine_schedule_with_warmup(
    optimizer: Optimizer,
    num_training_steps: int,
    *,
    num_warmup_steps: int = 0,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> LambdaLR:
    """Linear warmup, then cosine decay.

    ``lr(t) = lr0 * t / w`` for ``t < w``, then
    ``lr0 * (m + (1 - m) * 0.5 * (1 + cos(2 pi c p)))`` with ``p = (t - w) / (T - w)``,
    ``m = min_lr_ratio``, ``c = num_cycles`` (0.5: one half-cosine from lr0 to m * lr0).

    Args:
        optimizer: The optimizer whose learning rates are scheduled.
        num_training_steps: Total optimizer steps ``T`` (supplied by the recipe).
        num_warmup_steps: Warmup steps ``w``.
        min_lr_ratio: Floor of the decay as a fraction of the peak learning rate.
        num_cycles: Number of cosine cycles over the decay phase.

    Returns:
        A ``LambdaLR`` stepped once per optimizer step.
    """

    def lr_lambda(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        progress = min(progress, 1.0)
        cosine = 0.5 * (1.0 + math.cos(2.0 * math.pi * num_cycles * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * cosine

    return LambdaLR(optimizer, lr_lambda)


def constant_schedule_with_warmup(
    optimizer: Optimizer, num_training_steps: int, *, num_warmup_steps: int = 0
) -> LambdaLR:
    """Linear warmup to the configured learning rate, then constant.

    Args:
        optimizer: The optimizer whose learning rates are scheduled.
        num_training_steps: Total optimizer steps (unused; accepted so schedules swap freely).
        num_warmup_steps: Warmup steps.

    Returns:
        A ``LambdaLR`` stepped once per optimizer step.
    """
    del num_training_steps
    return LambdaLR(optimizer, lambda step: min(1.0, step / max(1, num_warmup_steps)))
