"""Multi-turn sampling on the training model with one KV cache kept across an episode's turns.

Each episode is one row of the cache. A turn appends new tokens to a row (the prompt at the
first turn; the template's and the tools' tokens after a tool call) and prefills only those,
then samples the row's reply one token at a time. Nothing already in the cache is run again:
prefill work per episode is its prompt plus its tool results, not the whole conversation per
turn.

Rows extend by different numbers of tokens; the batch is padded after each row's new tokens.
A padding token at position ``p`` writes slot ``p`` of its row, past the row's last real
token: the row's own token at ``p`` overwrites it before any query can see it (a query at
``p`` sees slots ``<= p``), as in ``ModelRolloutEngine``. Padding that would land past the
budget goes to a scratch slot at the cache's end that no real token uses.

Sampling is per row from the row's own generator (:func:`tunelab.rl.sample_tokens`), so an
episode's tokens do not depend on its batch, the number of processes or a resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from tunelab.distributed import hold_gathered
from tunelab.distributed.frozen_base import memory_budget_bytes
from tunelab.errors import ConfigError
from tunelab.peft import merged_adapters
from tunelab.rl.decoding import forwards_communicate
from tunelab.rl.rollout import SamplingSettings, behaviour_logps_of, sample_tokens
from tunelab.training.reference import reshard_all

__all__ = ["CachedTurnSampler"]


def any_rank(value: bool) -> bool:
    """Whether ``value`` holds on any rank (every rank runs the same forwards under FSDP2)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor(float(value), dtype=torch.float64)
        dist.all_reduce(flag)
        return bool(flag > 0)
    return value


def filled_mask(positions: torch.Tensor, reach: int) -> torch.Tensor:
    """The cache mask over its first ``reach`` slots: query at ``p`` sees slots ``<= p``.

    ``reach`` is one past the furthest position a real token of the forward holds; slots from
    there on are neither read nor needed (padding rows' outputs are never used).

    Args:
        positions: long ``[rows, seq]`` cache slots of the forward's tokens.
        reach: slots to cover.

    Returns:
        bool ``[rows, seq, reach]``.
    """
    return torch.arange(reach)[None, None, :] <= positions[:, :, None]


class CachedTurnSampler:
    """Samples turns of many episodes at once from the policy, the KV cache kept between turns.

    Use as a context manager around one batch of episodes (:meth:`session`); inside it call
    :meth:`turn` once per turn on every rank.

    Args:
        model: The policy (a ``TransformerDecoder``, plain or FSDP2-sharded).
        settings: Sampling settings; ``max_new_tokens`` bounds one turn, ``stop_ids`` end it.
        pad_id: Token that fills short rows.
        gather_once: Hold FSDP2's gathered parameters for the whole session.
        merge_adapters: Merge LoRA adapters into temporary weights for the session.

    Raises:
        ConfigError: ``model`` is a vision-language model (not supported yet).
    """

    def __init__(
        self,
        model: nn.Module,
        settings: SamplingSettings,
        *,
        pad_id: int,
        gather_once: bool = True,
        merge_adapters: bool = True,
    ) -> None:
        vision = getattr(getattr(model, "args", None), "vision", None)
        if vision is not None:
            # Its forward takes no cache mask, and a sampler would have to ban its image and
            # video tokens as ModelRolloutEngine does (the update pass reads them as pixels).
            raise ConfigError(
                f"agentic: episodes on a vision-language model ({vision.layout}) are not "
                "supported yet; use grpo_distributed without the agentic section"
            )
        self.model = model
        self.settings = settings
        self.pad_id = pad_id
        self.gather_once = gather_once
        self.merge_adapters = merge_adapters
        self.lengths: list[int] = []
        self.pending: list[int | None] = []
        self.capacity = 0
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.entropy_sum = 0.0
        self.last_logps: list[list[float]] = []

    @contextlib.contextmanager
    def session(self, rows: int, capacity: int) -> Iterator[CachedTurnSampler]:
        """Allocate the cache for ``rows`` episodes of at most ``capacity`` tokens each."""
        model = self.model
        device = model.model.embed_tokens.weight.device
        was_training = model.training
        model.eval()
        self.check_memory(rows, capacity + 1)
        self.capacity = capacity
        self.lengths = [0] * rows
        self.pending = [None] * rows
        self.prefill_tokens = self.generated_tokens = 0
        self.entropy_sum = 0.0
        model.setup_caches(rows, capacity + 1, device=device)  # +1: the scratch slot
        held = hold_gathered(model, gather_now=self.merge_adapters) if self.gather_once else None
        merged = merged_adapters(model) if self.merge_adapters else contextlib.nullcontext()
        try:
            with held or contextlib.nullcontext(), merged:
                yield self
        finally:
            model.teardown_caches()
            model.train(was_training)
            reshard_all(model)

    def check_memory(self, rows: int, length: int) -> None:
        """Refuse a KV cache larger than the memory this process may use, before allocating it.

        Raises:
            ConfigError: ``rows x length x layers x 2 x KV heads x head_dim x bytes`` exceeds
                :func:`~tunelab.distributed.frozen_base.memory_budget_bytes` (plus what
                torch's CUDA allocator holds unused).
        """
        args = self.model.args
        weight = self.model.model.embed_tokens.weight
        element = weight.element_size()
        needed = rows * length * args.num_layers * 2 * args.num_kv_heads * args.head_dim * element
        free = memory_budget_bytes(weight.device)
        if weight.device.type == "cuda":  # blocks torch holds but does not use are free to it
            free += torch.cuda.memory_reserved(weight.device) - torch.cuda.memory_allocated(
                weight.device
            )
        if needed > free:
            raise ConfigError(
                f"agentic episodes need {needed / 2**30:.1f} GiB for the KV cache ({rows} "
                f"episodes x {length} tokens (prompt + agentic.max_episode_tokens) x "
                f"{args.num_layers} layers x 2 x {args.num_kv_heads} KV heads x "
                f"{args.head_dim} x {element} bytes), more than the {free / 2**30:.1f} GiB free "
                f"for this process on {weight.device}; lower agentic.max_episode_tokens, "
                "schedule.batch_size or rollout.num_generations"
            )

    @torch.no_grad()
    def turn(
        self,
        new_tokens: list[list[int] | None],
        generators: list[torch.Generator],
        max_new_tokens: list[int],
    ) -> list[list[int]]:
        """Append ``new_tokens`` to each row, then sample each row's reply.

        Args:
            new_tokens: Per row, the tokens to add before its reply, or None for a row that
                takes no turn (its episode has ended).
            generators: One generator per row (an episode keeps its own across turns).
            max_new_tokens: Per row, the tokens its reply may have at most (its remaining
                budget, capped by ``settings.max_new_tokens``); 0 for a row without a turn.

        Returns:
            Per row, the reply's tokens (its stop token included when sampled); empty for a
            row without a turn. ``last_logps`` then holds, per row, each reply token's
            log-prob at temperature 1 (the behaviour log-probs of
            :mod:`tunelab.rl.off_policy`, as ``ModelRolloutEngine.last_logps``).
        """
        model = self.model
        device = model.model.embed_tokens.weight.device
        rows = len(new_tokens)
        scratch = self.capacity
        # The previous reply's last token was sampled but never fed: it goes first.
        inputs = []
        for row, tokens in enumerate(new_tokens):
            pending = [self.pending[row]] if self.pending[row] is not None else []
            inputs.append(pending + list(tokens) if tokens is not None else [])
        width = max(1, max(len(tokens) for tokens in inputs))
        batch = torch.full((rows, width), self.pad_id, dtype=torch.long)
        positions = torch.full((rows, width), scratch, dtype=torch.long)
        for row, tokens in enumerate(inputs):
            start = self.lengths[row]
            batch[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            positions[row] = torch.arange(start, start + width).clamp(max=scratch)
            if not tokens:
                positions[row] = scratch
        self.prefill_tokens += sum(len(tokens) for tokens in inputs)
        # Attention reads only the slots a real token of this forward may see.
        reach = max((self.lengths[row] + len(t) for row, t in enumerate(inputs) if t), default=1)
        hidden = model(
            batch.to(device),
            input_pos=positions.to(device),
            mask=filled_mask(positions, reach).to(device),
            return_hidden=True,
        )
        last = torch.tensor([max(len(tokens), 1) - 1 for tokens in inputs], device=device)
        logits = model.output(hidden[torch.arange(rows, device=device), last])
        for row, tokens in enumerate(inputs):
            self.lengths[row] += len(tokens)
            self.pending[row] = None
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        budget = torch.tensor(max_new_tokens, dtype=torch.long)
        active = torch.tensor([bool(tokens) for tokens in inputs]) & (budget > 0)
        replies = torch.full((rows, max(1, max(max_new_tokens))), self.pad_id, dtype=torch.long)
        reply_logps = torch.zeros(replies.shape, dtype=torch.float32)
        counts = torch.zeros(rows, dtype=torch.long)
        stop_ids = torch.tensor(sorted(self.settings.stop_ids), dtype=torch.long)
        # Held gathered (or one process), a forward is local: each rank stops when its own
        # rows do, with no per-token all-reduce holding it to the others.
        lockstep = forwards_communicate(model)
        while True:
            # The policy's entropy at each sampled position, as ModelRolloutEngine logs it
            # (before temperature and filtering).
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            entropy = -(log_probs.exp() * log_probs).sum(dim=-1).double().cpu()
            self.entropy_sum += float(entropy[active].sum())
            sampled = sample_tokens(logits, self.settings, generators, active.tolist())
            next_tokens = sampled.cpu()
            live = active.nonzero()[:, 0]
            replies[live, counts[live]] = next_tokens[live]
            chosen = behaviour_logps_of(log_probs, sampled)
            reply_logps[live, counts[live]] = chosen[live]
            counts += active
            finished = active & (torch.isin(next_tokens, stop_ids) | (counts >= budget))
            for row in finished.nonzero()[:, 0].tolist():
                self.pending[row] = int(next_tokens[row])
            active &= ~finished
            if not (any_rank(bool(active.any())) if lockstep else bool(active.any())):
                break
            feed = torch.where(active, next_tokens, self.pad_id)[:, None]
            where = torch.where(active, lengths, scratch)[:, None]
            reach = int(lengths[active].max()) + 1 if bool(active.any()) else 1
            lengths += active
            hidden = model(
                feed.to(device),
                input_pos=where.to(device),
                mask=filled_mask(where, reach).to(device),
                return_hidden=True,
            )
            logits = model.output(hidden[:, -1])
        self.lengths = lengths.tolist()
        out = [reply[:count] for reply, count in zip(replies.tolist(), counts.tolist())]
        self.last_logps = [
            values[:count] for values, count in zip(reply_logps.tolist(), counts.tolist())
        ]
        self.generated_tokens += sum(len(reply) for reply in out)
        return out
