"""Training: the building blocks recipes call, and the components configs name.

A recipe (``recipes/*.py``) writes its training step out in full; these are the parts it
calls, each with one job:

- set-up: :func:`build_model` (meta build, LoRA, FSDP2, sharded load), :func:`build_data`
  (from :class:`Datasets`), :func:`build_optimizer`, :func:`build_checkpoint_client` (of a
  :class:`TrainState`), :func:`resume`,
  :func:`config_fingerprint`;
- the step: :func:`to_device`, :func:`output_layer`, :func:`forward`, :func:`batch_loss`,
  :class:`RouterLoss`, :func:`global_token_count`,
  :class:`OptimizerStep` (clip, the :class:`NonFiniteGuard` check, step, schedule);
- preference tuning: :func:`policy_forward`, :class:`ReferenceModel`,
  :class:`PrecomputedReference`, :func:`preference_loss`, :func:`global_pair_count`, :func:`global_preference_metrics`;
- KTO: :func:`mismatched_logps`, :func:`step_kl`, :func:`completion_forward`, :func:`kto_forward`,
  :func:`kto_loss`,
  :func:`global_kto_metrics`, :func:`evaluate_kto`;
- after the step: :class:`AfterStep` (progress, metrics, validation, benchmarks, export,
  save, stop), with :class:`Schedule`, :class:`StepReports`, :class:`StepBenchmarks` (what ``AfterStep`` needs of
  ``tunelab.eval.TrainingEval``), :class:`MetricLoggers`, :class:`ProgressBar`,
  :class:`StepProfiler`;
  :func:`evaluate`, :func:`evaluate_preference`, :func:`peak_memory_gib`.

Online RL (GRPO, GSPO) has its own package above this one: :mod:`tunelab.rl`.

Components for configs: ``adamw``, the LR schedules and the metric loggers.
"""

from tunelab.training.kto import (
    check_unpaired_loss,
    completion_forward,
    evaluate_kto,
    global_kto_metrics,
    kto_forward,
    kto_loss,
    mismatched_logps,
    step_kl,
)
from tunelab.training.loop import (
    ActivationOffload,
    NonFiniteGuard,
    OptimizerStep,
    RouterLoss,
    batch_loss,
    evaluate,
    forward,
    global_token_count,
    output_layer,
    peak_memory_gib,
    to_device,
)
from tunelab.training.lr_schedules import constant_schedule_with_warmup, cosine_schedule_with_warmup
from tunelab.training.metric_logging import (
    JsonlLogger,
    MetricLogger,
    StdoutLogger,
    TensorBoardLogger,
    WandBLogger,
)
from tunelab.training.optim import adamw
from tunelab.training.preference import (
    check_preference_loss,
    evaluate_preference,
    global_chosen_tokens_per_pair,
    global_pair_count,
    global_preference_metrics,
    preference_loss,
    step_references,
)
from tunelab.training.profiler import StepProfiler
from tunelab.training.progress import ProgressBar
from tunelab.training.reference import (
    PolicyOutput,
    PrecomputedReference,
    ReferenceLogps,
    ReferenceModel,
    policy_forward,
)
from tunelab.training.reward_model import (
    check_reward_loss,
    evaluate_rewards,
    pair_rewards,
    reward_loss,
)
from tunelab.training.rng import seed_everything
from tunelab.training.session import (
    AfterStep,
    Datasets,
    MetricLoggers,
    Schedule,
    StepBenchmarks,
    StepReports,
    TrainingData,
    TrainState,
    build_checkpoint_client,
    build_data,
    build_optimizer,
    resume,
)
from tunelab.training.setup import build_model, config_fingerprint, load_model

__all__ = [
    "ActivationOffload",
    "AfterStep",
    "Datasets",
    "config_fingerprint",
    "JsonlLogger",
    "MetricLogger",
    "MetricLoggers",
    "NonFiniteGuard",
    "OptimizerStep",
    "PolicyOutput",
    "PrecomputedReference",
    "ProgressBar",
    "ReferenceLogps",
    "ReferenceModel",
    "Schedule",
    "StdoutLogger",
    "StepBenchmarks",
    "StepReports",
    "StepProfiler",
    "TensorBoardLogger",
    "TrainingData",
    "TrainState",
    "WandBLogger",
    "adamw",
    "RouterLoss",
    "batch_loss",
    "build_checkpoint_client",
    "build_data",
    "build_model",
    "load_model",
    "build_optimizer",
    "constant_schedule_with_warmup",
    "cosine_schedule_with_warmup",
    "evaluate",
    "check_preference_loss",
    "check_unpaired_loss",
    "completion_forward",
    "evaluate_kto",
    "global_chosen_tokens_per_pair",
    "global_kto_metrics",
    "kto_loss",
    "kto_forward",
    "mismatched_logps",
    "step_kl",
    "check_reward_loss",
    "evaluate_rewards",
    "pair_rewards",
    "reward_loss",
    "evaluate_preference",
    "forward",
    "global_pair_count",
    "global_preference_metrics",
    "global_token_count",
    "output_layer",
    "peak_memory_gib",
    "policy_forward",
    "preference_loss",
    "step_references",
    "resume",
    "seed_everything",
    "to_device",
]
