"""The GRPO recipe's rollout phase: sample groups, score them, refill the dropped ones.

:func:`group_advantages` turns each group's rewards into advantages (DeepSeekMath, Shao et al.
2024, arXiv:2402.03300, eq. 3; Dr. GRPO without the std, Liu et al. 2025, arXiv:2503.20783)::

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)      scale_rewards=True (GRPO, DAPO)
    A_i =  r_i - mean(r_1..r_G)                               scale_rewards=False (Dr. GRPO)

:class:`GroupSampler` turns prompt indices into a scored micro-batch of rollouts (G completions
per prompt, rewards, group advantages, the rows the loss keeps); its ``refill`` is DAPO's
dynamic sampling with re-sampling. :func:`step_counts` and :func:`grpo_metrics` turn a step's
sums into its metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tunelab.config.sections import RolloutArgs
from tunelab.distributed import all_reduce_sum
from tunelab.rl.rewards import Rewards
from tunelab.rl.rollout import ModelRolloutEngine
from tunelab.rl.step import (
    Rollout,
    behaviour_logps_batch,
    exact_parts,
    global_sums,
    prompt_images,
    rollout_batch,
    sampling_seeds,
)

__all__ = [
    "Completions",
    "GroupSampler",
    "group_advantages",
    "ScoredGroups",
    "grpo_metrics",
    "grpo_throughputs",
    "off_policy_metrics",
    "refill_indices",
    "step_counts",
]

_MIX = 0x9E3779B97F4A7C15


def group_advantages(
    rewards: torch.Tensor, num_generations: int, *, scale_rewards: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Group-relative advantages of consecutive groups of ``num_generations`` rewards.

    Args:
        rewards: ``[num_groups * num_generations]``, each group's completions consecutive.
        num_generations: Completions per prompt (``G``, at least 2 for a std).
        scale_rewards: Divide by the group's std (+ ``eps``); False for Dr. GRPO.
        eps: Added to the std, so a group of equal rewards gets advantages 0, not NaN.

    Returns:
        ``[num_groups * num_generations]`` advantages in the rewards' dtype.

    Raises:
        ValueError: If the rewards do not split into whole groups.
    """
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards must be [groups * {num_generations}], got shape {tuple(rewards.shape)}"
        )
    groups = rewards.view(-1, num_generations)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_rewards:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


@dataclass
class ScoredGroups:
    """One micro-batch of sampled and scored groups.

    Attributes:
        rollout: The rows for the policy-gradient passes (``keep`` marks the rows the loss
            counts).
        records: One ``completions.jsonl`` record per completion.
        sums: This rank's sums for the step's metrics (:func:`grpo_metrics`).
    """

    rollout: Rollout
    records: list[dict[str, Any]]
    sums: dict[str, float]


@dataclass
class Completions:
    """What a rollout phase generated for the repeated prompts, before it is scored.

    Attributes:
        texts: What the reward functions read as each completion.
        rows: The row each reward function reads with it.
        batch: The rows for the policy-gradient passes (``rollout_batch``).
        lengths: Trained tokens per completion (float64).
        records: Per completion, its ``completions.jsonl`` fields (before the reward).
        sums: The rollout's own sums for the step's metrics (``generation_seconds``,
            ``entropy``, ...).
        extra_rewards: Rewards added to the weighted sum: name -> (weight, values).
        behaviour_logps: The sampled tokens' log-probs as a batch, when recorded.
    """

    texts: list[str]
    rows: list[dict[str, Any]]
    batch: dict[str, torch.Tensor]
    lengths: torch.Tensor
    records: list[dict[str, Any]]
    sums: dict[str, float]
    extra_rewards: dict[str, tuple[float, torch.Tensor]]
    behaviour_logps: torch.Tensor | None = None


class GroupSampler:
    """Samples ``num_generations`` completions per prompt, scores them, computes advantages.

    Args:
        engine: The rollout engine.
        rewards: The reward functions.
        prompts: The prompt dataset (``tokens``, ``prompts`` and ``rows`` by index).
        decode: Token ids to text (the tokenizer's ``decode``).
        pad_id: Token after each rollout row's end (the tokenizer's).
        num_generations: G, completions per prompt.
        seed: The run's seed (sampling seeds and refill prompts derive from it).
        scale_rewards: Divide each group's centred rewards by its std.
        dynamic_sampling: Leave the groups whose rewards are all equal out of the loss.
        device: Where rollout batches go.
    """

    def __init__(
        self,
        engine: ModelRolloutEngine,
        rewards: Rewards,
        prompts: Any,
        *,
        decode: Any,
        pad_id: int,
        num_generations: int,
        seed: int,
        scale_rewards: bool,
        dynamic_sampling: bool,
        device: torch.device,
    ) -> None:
        self.engine, self.rewards, self.prompts = engine, rewards, prompts
        self.decode, self.pad_id, self.num_generations = decode, pad_id, num_generations
        self.seed, self.scale_rewards, self.dynamic_sampling = seed, scale_rewards, dynamic_sampling
        self.device = device

    @classmethod
    def from_settings(
        cls,
        engine: ModelRolloutEngine,
        rewards: Rewards,
        prompts: Any,
        rollout: RolloutArgs,
        *,
        seed: int,
        device: torch.device,
    ) -> GroupSampler:
        """The rollout phase a recipe's ``rollout`` section describes, taken whole.

        Args:
            engine: The rollout engine (its ``decode`` and ``pad_id`` are the tokenizer's).
            rewards: The reward functions (``Rewards.from_settings``: with the ``rewards``
                section's ``scale``).
            prompts: The prompt dataset.
            rollout: The ``rollout`` settings (``num_generations``, ``dynamic_sampling``).
            seed: The run's seed.
            device: Where rollout batches go.
        """
        return cls(
            engine,
            rewards,
            prompts,
            decode=engine.decode,
            pad_id=engine.pad_id,
            num_generations=rollout.num_generations,
            seed=seed,
            scale_rewards=rewards.scale,
            dynamic_sampling=rollout.dynamic_sampling,
            device=device,
        )

    def sample(self, indices: list[int], step: int, refill_round: int = 0) -> ScoredGroups:
        """Sample, score and keep the groups of the prompts ``indices`` at optimizer step ``step``.

        Args:
            indices: Dataset indices of this rank's prompts.
            step: Optimizer steps taken before this one (the sampling seeds depend on it).
            refill_round: 0 for the step's own prompts; the refill round otherwise (its
                records carry it and its completions do not count in the reward metrics).

        Returns:
            The scored micro-batch.
        """
        num_generations = self.num_generations
        repeated = [index for index in indices for _ in range(num_generations)]
        seeds = sampling_seeds(self.seed, step, indices, num_generations, refill_round=refill_round)
        done = self.complete(repeated, seeds)
        prompts = [self.prompts.prompts[index] for index in repeated]
        total, each = self.rewards(prompts, done.texts, done.rows)
        for name, (weight, values) in done.extra_rewards.items():
            total = total + weight * values.to(total.dtype)
            each = each | {name: values}
        advantages = group_advantages(total, num_generations, scale_rewards=self.scale_rewards)
        keep = torch.ones(len(done.texts), dtype=torch.bool)
        if self.dynamic_sampling:  # groups of equal rewards teach nothing: leave them out
            keep = (total.view(-1, num_generations).std(dim=1) > 0).repeat_interleave(
                num_generations
            )
        extra = {"round": refill_round} if refill_round else {}
        records = [
            {"index": indices[i // num_generations], "sample": i % num_generations, **extra,
             **record, "reward": float(total[i])}
            for i, record in enumerate(done.records)
        ]  # fmt: skip
        sums: dict[str, float] = {"num_tokens": float((done.lengths * keep).sum())}
        sums["num_sequences"] = float(keep.sum())
        if refill_round:
            sums["refill_prompts"] = float(len(indices))
        else:  # the reward metrics describe the step's own prompts only
            sums |= {
                "num_completions": float(len(done.texts)),
                "completion_tokens": float(done.lengths.sum()),
                # Exact in any grouping: 2 processes log 1 process's reward to the last bit.
                **exact_parts("reward", total),
                **exact_parts("reward_squares", total.double() ** 2),
                **{
                    key: value
                    for name, values in each.items()
                    for key, value in exact_parts(f"rewards/{name}", values).items()
                },
                **done.sums,
            }
        rollout = Rollout(done.batch, advantages.to(self.device), keep.to(self.device))
        rollout.behaviour_logps = done.behaviour_logps
        return ScoredGroups(rollout, records, sums)

    def complete(self, repeated: list[int], seeds: list[int]) -> Completions:
        """Generate one completion per entry of ``repeated`` (dataset indices), each from its seed."""
        data = self.prompts
        prompts = [data.tokens[index] for index in repeated]
        images = prompt_images(data, repeated)
        with_images = {} if images is None else {"images": images}
        completions = self.engine.generate(prompts, seeds, **with_images)
        texts = [self.decode(completion) for completion in completions]
        # The token ids too: decoded text does not always encode back to them (a byte-level
        # BPE splits differently, a stop token is not in the text), and the loss is theirs.
        records = [
            {"completion": text, "completion_ids": list(completion)}
            for text, completion in zip(texts, completions, strict=True)
        ]
        batch = rollout_batch(prompts, completions, self.pad_id, self.device, images)
        behaviour = None
        recorded = getattr(self.engine, "last_logps", None)
        if recorded and len(recorded) == len(completions):  # an engine may record none
            width = batch["tokens"].shape[1]
            behaviour = behaviour_logps_batch(prompts, recorded, width, self.device)
        return Completions(
            texts=texts,
            rows=[data.rows[index] for index in repeated],
            batch=batch,
            lengths=torch.tensor([len(c) for c in completions], dtype=torch.float64),
            records=records,
            sums={
                "generation_seconds": self.engine.last_generation_seconds,
                "entropy": self.engine.last_entropy_sum,
            },
            extra_rewards={},
            behaviour_logps=behaviour,
        )

    def refill(
        self, scored: list[ScoredGroups], step: int, *, prompts_per_round: int, max_rounds: int
    ) -> list[ScoredGroups]:
        """DAPO's re-sampling: sample more prompts until the step has as many kept groups as it has.

        Dynamic sampling leaves out the groups whose rewards are all equal. Each round, every
        rank samples ``prompts_per_round`` more prompts (:func:`refill_indices`: drawn from
        the seed, the step and the round, so a resumed run draws the same ones and nothing
        goes into the checkpoint), until the kept groups over all ranks reach the step's
        number of groups or ``max_rounds`` rounds ran. The round's groups count in a fixed
        global order (rank by rank) and those beyond the target are dropped, so every rank
        agrees on the result without another exchange, and 1 or N processes with the same
        global round size keep the same groups. A collective: every rank calls it.

        Args:
            scored: The step's own micro-batches.
            step: Optimizer steps taken before this one.
            prompts_per_round: Prompts per rank per round.
            max_rounds: Rounds at most (0: none).

        Returns:
            The refill micro-batches (keep them with the step's own).
        """
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        refills = self.refill_ranks(
            {rank: scored},
            step,
            prompts_per_round=prompts_per_round,
            max_rounds=max_rounds,
            world_size=world,
            reduce=all_reduce_sum,
        )
        return refills[rank]

    def refill_ranks(
        self,
        scored: dict[int, list[ScoredGroups]],
        step: int,
        *,
        prompts_per_round: int,
        max_rounds: int,
        world_size: int,
        reduce: Callable[[torch.Tensor], torch.Tensor],
    ) -> dict[int, list[ScoredGroups]]:
        """:meth:`refill` for several sampling ranks at once: those ``scored`` holds.

        A rollout rank (``rollout.ranks``) samples for its trainers: it refills as each of them
        would, and the rollout ranks together as every trainer would, so their refills are
        those of the run whose processes are the trainers.

        Args:
            scored: Sampling rank (of ``world_size``) -> the step's own micro-batches.
            step: Optimizer steps taken before this one.
            prompts_per_round: Prompts per sampling rank per round.
            max_rounds: Rounds at most (0: none).
            world_size: The sampling ranks in all.
            reduce: Sums a tensor in place over the processes that refill the other
                sampling ranks (and returns it).

        Returns:
            Each sampling rank's refill micro-batches.
        """
        num_generations = self.num_generations
        parts = [part for own in scored.values() for part in own]
        counts = reduce(
            torch.tensor(
                [
                    sum(s.rollout.keep.numel() for s in parts) / num_generations,
                    sum(float(s.rollout.keep.sum()) for s in parts) / num_generations,
                ],
                dtype=torch.float64,
                device=self.device,
            )
        ).tolist()
        target, kept = round(counts[0]), round(counts[1])
        refills: dict[int, list[ScoredGroups]] = {rank: [] for rank in scored}
        for refill_round in range(1, max_rounds + 1):
            if kept >= target:
                break
            everyone = refill_indices(
                self.seed, step, refill_round, len(self.prompts), prompts_per_round * world_size
            )
            flags = torch.zeros(
                prompts_per_round * world_size, dtype=torch.float64, device=self.device
            )
            extras = {}
            for rank in scored:
                mine = slice(rank * prompts_per_round, (rank + 1) * prompts_per_round)
                extras[rank] = self.sample(everyone[mine], step, refill_round)
                keep = extras[rank].rollout.keep.view(-1, num_generations)[:, 0]
                flags[mine] = keep.to(flags.dtype)
            flags = reduce(flags)
            allowed = (flags > 0) & (kept + flags.cumsum(0) <= target)
            kept += int(allowed.sum())
            for rank, extra in extras.items():
                mine = slice(rank * prompts_per_round, (rank + 1) * prompts_per_round)
                keep = allowed[mine].repeat_interleave(num_generations)
                lengths = (extra.rollout.batch["labels"] != -100).sum(dim=1)
                extra.rollout.keep = keep
                extra.sums["num_sequences"] = float(keep.sum())
                extra.sums["num_tokens"] = float((lengths * keep).sum())
                refills[rank].append(extra)
        return refills


def refill_indices(
    seed: int, step: int, refill_round: int, num_prompts: int, count: int
) -> list[int]:
    """The prompts of a refill round: ``count`` dataset indices from the seed, step and round.

    Drawn with replacement from the whole dataset, independently of the data loader (whose
    position the checkpoint saves), so refills change neither the epoch's data order nor the
    resume state.
    """
    value = seed
    for part in (step, refill_round):
        value = (value * _MIX + part + 1) % 2**63
    generator = torch.Generator().manual_seed(value)
    return torch.randint(num_prompts, (count,), generator=generator).tolist()


def step_counts(scored: list[ScoredGroups], device: torch.device) -> dict[str, float]:
    """The step's rollout sums (:attr:`ScoredGroups.sums`) over its micro-batches and all ranks."""
    sums: dict[str, float] = {}
    for part in scored:
        for key, value in part.sums.items():
            sums[key] = sums.get(key, 0.0) + value
    return global_sums(sums, device)


def grpo_metrics(
    counts: dict[str, float],
    step_totals: dict[str, float],
    rollout: RolloutArgs,
    *,
    divisor: float,
) -> dict[str, float]:
    """A GRPO step's metrics from its global sums (its throughputs: :func:`grpo_throughputs`).

    Args:
        counts: The rollout sums over all ranks (``ScoredGroups.sums``, summed).
        step_totals: The last pass's loss, clipped-token and KL sums over all ranks.
        rollout: The ``rollout`` settings: ``num_iterations`` (optimizer passes over the
            rollouts) and ``dynamic_sampling_refill_rounds`` (when above 0, ``refill_prompts``
            is logged: prompts sampled in refill rounds over all ranks, 0 when the step's own
            groups sufficed).
        divisor: The loss normalizer of the step.

    Returns:
        ``loss``, ``reward``, ``reward_std``, ``rewards/<name>``, ``completion_length``,
        ``entropy``, ``kept_fraction``, ``clip_fraction``, ``kl``, the refill count and
        :func:`off_policy_metrics` (quotients of two global sums: each token's copies under
        tensor parallelism cancel).
    """
    num_completions = counts["num_completions"]
    reward_mean = counts["reward"] / num_completions
    tokens = max(counts["num_tokens"], 1.0)
    metrics = {
        "loss": step_totals["loss"] / divisor,
        "reward": reward_mean,
        "reward_std": max(counts["reward_squares"] / num_completions - reward_mean**2, 0) ** 0.5,
        **{k: v / num_completions for k, v in counts.items() if k.startswith("rewards/")},
        # Agentic episodes' counts and timings (tunelab.rl.agentic.episode_sums), per episode.
        **{k: v / num_completions for k, v in counts.items() if k.startswith("agentic/")},
        "completion_length": counts["completion_tokens"] / num_completions,
        "entropy": counts["entropy"] / max(counts["completion_tokens"], 1.0),
        # The share of the step's batch (its own completions) that the loss uses; with refill
        # rounds the kept rows may come from extra prompts.
        "kept_fraction": counts["num_sequences"] / num_completions,
        "clip_fraction": step_totals["clipped"] / tokens,
        "kl": step_totals["kl"] / tokens,
    }
    if rollout.dynamic_sampling_refill_rounds > 0:
        metrics["refill_prompts"] = counts.get("refill_prompts", 0.0)
    return metrics | off_policy_metrics(step_totals)


def grpo_throughputs(
    counts: dict[str, float],
    *,
    world_size: int,
    train_seconds: float,
    token_copies: int = 1,
    num_iterations: int = 1,
) -> dict[str, float]:
    """A GRPO step's generation and training tokens per second.

    Args:
        counts: The rollout sums over all ranks (``ScoredGroups.sums``, summed).
        world_size: Processes (generation seconds are summed over them).
        train_seconds: Wall time of the log-prob and optimizer passes.
        token_copies: Processes that train on the same completions (the tensor-parallel
            size): the counts summed over processes hold each token this many times.
        num_iterations: Optimizer passes over the step's rollouts (``rollout.num_iterations``).

    Returns:
        ``generation_tokens_per_second`` and ``train_tokens_per_second``.
    """
    return {
        "generation_tokens_per_second": counts["completion_tokens"]
        / token_copies
        / max(counts["generation_seconds"] / world_size, 1e-9),
        "train_tokens_per_second": counts["num_tokens"]
        / token_copies
        * num_iterations
        / max(train_seconds, 1e-9),
    }


def off_policy_metrics(step_totals: dict[str, float]) -> dict[str, float]:
    """The trainer-vs-behaviour health metrics of a pass (none where no log-probs were recorded).

    ``off_policy/kl`` (k3 estimate of ``KL(behaviour || trainer)`` per token: ~1e-7 at lag 0,
    rounding only), ``off_policy/log_ratio_mean`` and ``_std`` (``log pi_old - log mu``), and
    ``off_policy/clip_fraction`` (tokens the correction truncated or masked; 0 at lag 0).
    """
    tokens = step_totals.get("off_policy/tokens", 0.0)
    if tokens <= 0:
        return {}
    mean = step_totals["off_policy/log_ratio"] / tokens
    squares = step_totals["off_policy/log_ratio_squares"] / tokens
    return {
        "off_policy/kl": step_totals["off_policy/kl"] / tokens,
        "off_policy/log_ratio_mean": mean,
        "off_policy/log_ratio_std": max(squares - mean**2, 0.0) ** 0.5,
        "off_policy/clip_fraction": step_totals["off_policy/clipped"] / tokens,
    }
