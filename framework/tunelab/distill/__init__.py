"""Knowledge distillation: the frozen teacher, on-policy batches and validation of the recipe.

The losses live in :mod:`tunelab.losses` (``DistillationLoss`` and its subclasses); see
docs/recipes.md (distill_distributed) for the step and the formulas.
"""

from tunelab.distill.step import (
    OnPolicyBatches,
    Teacher,
    distill_batch,
    evaluate_distillation,
    step_metrics,
)
from tunelab.distill.top_k_cache import TeacherTopKCache, TopKCacheKey, TopKCacheSpot

__all__ = [
    "OnPolicyBatches",
    "Teacher",
    "TeacherTopKCache",
    "TopKCacheKey",
    "TopKCacheSpot",
    "distill_batch",
    "evaluate_distillation",
    "step_metrics",
]
