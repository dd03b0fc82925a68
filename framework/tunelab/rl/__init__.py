"""Online RL with verifiable rewards: the parts ``recipes/grpo_distributed.py`` calls.

One module per concern, in the order a step uses them:

- rollouts: :class:`RolloutEngine` (the interface an engine implements) and
  :class:`ModelRolloutEngine` (generates with the training model), :class:`SamplingSettings`,
  :func:`sample_tokens`, :func:`sampling_seeds` (``rollout.py``, ``step.py``);
  :func:`bound_prompt_lengths` and :func:`cut_prompts` (``lengths.py``);
- rewards: :class:`Rewards` and the built-in reward functions (``rewards.py``);
- advantages: :func:`group_advantages`, :class:`GroupSampler` (sample, score, refill with
  dynamic sampling), :class:`ScoredGroups`, :func:`refill_indices`, :func:`step_counts`,
  :func:`grpo_metrics` and :func:`grpo_throughputs` (``advantages.py``);
- losses: :class:`PolicyLoss`, the base chosen with ``loss: _component_``
  (``policy_loss.py``), :class:`GRPOLoss` (GRPO, DAPO, Dr. GRPO; ``grpo_loss.py``) and
  :class:`GSPOLoss` (``gspo_loss.py``); a new loss is one subclass in one file;
- asynchronous GRPO: :class:`RolloutPipeline` and :func:`behaviour_step` (the fixed-depth
  schedule, ``async_rollouts.py``), :class:`OffPolicyCorrection`, :class:`TruncatedIS`,
  :class:`MaskedIS`, :func:`behaviour_sums` (``off_policy.py``); :func:`send_weights` and
  :func:`receive_weights` (checksummed, bounded transfers to rollout ranks, ``weight_sync.py``);
  :func:`lag_histogram`; the rollout/trainer rank split (``rollout.ranks``): :func:`split_ranks`,
  :class:`RankSplit`, :class:`RemoteRollouts` (a trainer's side), :func:`serve_rollouts` (a
  rollout rank's loop) (``rank_split.py``); the colocated overlap (``rollout.overlap``):
  :class:`ThreadRollouts`, :func:`gather_trainable` (``thread_rollouts.py``);
- the step: :class:`Rollout`, :func:`rollout_batch`, :func:`completion_logps`,
  :func:`store_logps`, :func:`policy_gradient_pass`, :class:`FrozenReference`,
  :func:`global_sums`, :func:`exact_parts`, :func:`exact_total`, :func:`write_completions`
  (``step.py``); :class:`RolloutValidation`
  (``validation.py``).

Layer: above ``tunelab.training`` (it runs the model's forward and the reference), below
``tunelab.eval`` (which generates with the rollout engine). See docs/recipes.md (GRPO) and
docs/losses.md (the policy losses).
"""

from tunelab.rl.advantages import (
    GroupSampler,
    ScoredGroups,
    group_advantages,
    grpo_metrics,
    grpo_throughputs,
    off_policy_metrics,
    refill_indices,
    step_counts,
)
from tunelab.rl.agentic import Environment, EpisodeGroupSampler, EpisodeRunner
from tunelab.rl.async_rollouts import InFlight, RolloutPipeline, behaviour_step, lag_histogram
from tunelab.rl.grpo_loss import GRPOLoss
from tunelab.rl.gspo_loss import GSPOLoss
from tunelab.rl.learned_reward import learned_reward
from tunelab.rl.lengths import bound_prompt_lengths, cut_prompts
from tunelab.rl.off_policy import (
    MaskedIS,
    OffPolicyCorrection,
    TruncatedIS,
    behaviour_sums,
    check_correction,
)
from tunelab.rl.policy_loss import (
    AGGREGATIONS,
    PolicyLoss,
    check_policy_loss,
    k3_kl,
    loss_normalizer,
)
from tunelab.rl.rank_split import RankSplit, RemoteRollouts, serve_rollouts, split_ranks
from tunelab.rl.rewards import (
    MAX_REWARD,
    Rewards,
    completion_length_reward,
    exact_answer_reward,
    math_verify_reward,
    regex_reward,
)
from tunelab.rl.rollout import ModelRolloutEngine, RolloutEngine, SamplingSettings, sample_tokens
from tunelab.rl.step import (
    FrozenReference,
    Rollout,
    behaviour_logps_batch,
    completion_logps,
    exact_parts,
    exact_total,
    global_sums,
    policy_gradient_pass,
    rollout_batch,
    sampling_seeds,
    store_logps,
    write_completions,
)
from tunelab.rl.thread_rollouts import ThreadRollouts, gather_trainable
from tunelab.rl.validation import RolloutValidation
from tunelab.rl.weight_sync import (
    TransferStats,
    WeightTransferError,
    receive_weights,
    send_weights,
)

__all__ = [
    "AGGREGATIONS",
    "Environment",
    "EpisodeGroupSampler",
    "EpisodeRunner",
    "FrozenReference",
    "GRPOLoss",
    "GSPOLoss",
    "GroupSampler",
    "InFlight",
    "MaskedIS",
    "MAX_REWARD",
    "ModelRolloutEngine",
    "OffPolicyCorrection",
    "PolicyLoss",
    "RankSplit",
    "RemoteRollouts",
    "Rewards",
    "Rollout",
    "RolloutEngine",
    "RolloutPipeline",
    "RolloutValidation",
    "SamplingSettings",
    "TransferStats",
    "ScoredGroups",
    "ThreadRollouts",
    "TruncatedIS",
    "WeightTransferError",
    "behaviour_logps_batch",
    "behaviour_step",
    "behaviour_sums",
    "bound_prompt_lengths",
    "check_correction",
    "check_policy_loss",
    "completion_length_reward",
    "completion_logps",
    "cut_prompts",
    "exact_answer_reward",
    "gather_trainable",
    "exact_parts",
    "exact_total",
    "global_sums",
    "group_advantages",
    "grpo_metrics",
    "grpo_throughputs",
    "lag_histogram",
    "k3_kl",
    "learned_reward",
    "loss_normalizer",
    "math_verify_reward",
    "off_policy_metrics",
    "policy_gradient_pass",
    "receive_weights",
    "refill_indices",
    "regex_reward",
    "rollout_batch",
    "sample_tokens",
    "sampling_seeds",
    "send_weights",
    "serve_rollouts",
    "split_ranks",
    "step_counts",
    "store_logps",
    "write_completions",
]
