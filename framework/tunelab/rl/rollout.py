"""Rollouts for online RL: a small engine interface and the built-in engine on the training model.

A :class:`RolloutEngine` turns prompt token ids into sampled completion token ids. The
built-in :class:`ModelRolloutEngine` decodes with the training model itself: every sequence of
the batch at once, with the model's KV cache, one forward per new token. Another engine (vLLM)
plugs in behind the same two methods: ``generate``, and ``update_weights`` after each
optimizer step (the built-in engine samples from the live model and needs none). See
docs/recipes.md for the vLLM plan.

Sampling is reproducible per sequence: each sequence draws from its own generator seeded
from ``seeds[i]`` (the recipe derives it from the run's seed, the step and the prompt's dataset
index), so the tokens do not depend on the batch, the number of processes, or a resume.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from tunelab.config.sections import RolloutArgs
from tunelab.distributed import hold_gathered
from tunelab.distributed.frozen_base import memory_budget_bytes
from tunelab.errors import ConfigError
from tunelab.modules.packed_linear import packed_linears
from tunelab.peft import merged_adapters
from tunelab.rl.decoding import (
    DecodeBatch,
    DecodeStep,
    bucket_length,
    distinct_prompts,
    forwards_communicate,
)
from tunelab.training.reference import reshard_all

__all__ = [
    "ModelRolloutEngine",
    "PromptImages",
    "RolloutEngine",
    "SamplingSettings",
    "sample_tokens",
]

PromptImages = Mapping[str, torch.Tensor]
"""A prompt's images as a vision-language model's forward takes them: ``pixel_values`` and
``image_grid_thw`` (``tunelab.data.PromptDataset.prompt_images``)."""


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are sampled.

    Attributes:
        max_new_tokens: Tokens a completion has at most.
        temperature: Softmax temperature (0: greedy).
        top_p: Nucleus sampling: keep the smallest set of tokens whose probability reaches it.
        top_k: Keep the k most likely tokens (None: all).
        stop_ids: Tokens that end a completion (kept in it): the tokenizer's EOS and friends.
        stop_strings: Texts that end a completion once its decoded text contains one (the
            token that completes it is kept); needs the engine's ``decode``.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()


def sample_tokens(
    logits: torch.Tensor,
    settings: SamplingSettings,
    generators: list[torch.Generator],
    active: list[bool] | None = None,
) -> torch.Tensor:
    """One token per row: temperature, then top-k, then top-p, each row from its generator.

    Each row races its tokens: ``argmax(p / q)`` with ``q = -log(u)``, ``u`` uniform in float32
    from the row's own generator, one per vocabulary entry (the exponential race, Gumbel-max in
    exponential form, as vLLM samples). The uniforms are drawn per row (``uniform_``, a plain
    fill) and turned into exponentials by one ``log`` over the whole batch, a third of the CPU
    of ``exponential_`` per row. A row's token depends only on its logits and its generator,
    never on the other rows; a token of zero probability is never drawn; and a perturbation
    of the logits far below the gap between the two best ``p / q`` (merged against unmerged
    adapter weights) leaves the token unchanged. tests/unit/test_grpo_rollout_speed.py checks
    the tokens against a per-row reference and the frequencies against the probabilities.

    Args:
        logits: ``[rows, vocab]``.
        settings: Temperature, top-k, top-p.
        generators: One CPU generator per row.
        active: Rows that draw (None: all); the others take their most likely token and
            leave their generator untouched (a finished completion's token is never used).

    Returns:
        ``[rows]`` token ids.

    Raises:
        ValueError: A row's probabilities are not finite (the policy's logits hold NaN or inf).
    """
    if settings.temperature <= 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    if settings.temperature != 1.0:  # x / 1.0 is x: skip the op
        logits = logits / settings.temperature
    if settings.top_k is not None and settings.top_k < logits.shape[-1]:
        kth = torch.topk(logits, settings.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= settings.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    probs = probs.cpu()
    # A NaN or inf anywhere makes the sum non-finite (probabilities are >= 0): one reduction.
    if not math.isfinite(float(probs.sum())):
        raise ValueError(
            "the sampling probabilities are not finite: the policy's logits hold NaN or inf "
            "(a diverged update; lower the learning rate or clip gradients)"
        )
    # A row that does not draw races against a constant: its most likely token wins.
    uniforms = torch.full_like(probs, 0.5)
    for row, generator in enumerate(generators):
        if active is None or active[row]:
            uniforms[row].uniform_(generator=generator)
    # u = 0 gives q = inf: that token loses, as it would against an infinite exponential draw.
    return (probs / uniforms.log_().neg_()).argmax(dim=-1).to(logits.device)


def behaviour_logps_of(log_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's sampled token's log-prob, on the CPU: the behaviour log-probs a sampler records.

    Args:
        log_probs: ``[rows, vocab]`` fp32 log-softmax of the logits at temperature 1, as the
            trainer computes them.
        tokens: ``[rows]`` the sampled tokens.

    Returns:
        ``[rows]`` fp32, so that an off-policy correction never recomputes them.
    """
    return log_probs.gather(-1, tokens[:, None])[:, 0].cpu()


class RolloutEngine(Protocol):
    """What the GRPO recipe needs of a generator of completions."""

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        images: Sequence[PromptImages | None] | None = None,
    ) -> list[list[int]]:
        """Sample one completion per prompt (repeat a prompt G times for a group).

        Args:
            prompts: Prompt token ids, one list per sequence.
            seeds: One sampling seed per sequence.
            images: Each prompt's images (None: a text prompt), for a vision-language
                model; the G rows of a group pass the same object.

        Returns:
            The completion token ids of each sequence (a stop token, when sampled, included).
        """
        ...

    def update_weights(self, model: nn.Module) -> None:
        """Take the policy's new weights (after an optimizer step)."""
        ...


class ModelRolloutEngine:
    """Generation on the training model: all sequences batched, with the KV cache.

    Prompts of different lengths share one batch without left padding: the cache takes a
    position per row, so each row's prompt sits at positions ``0..len - 1`` (the positions
    the training forward gives it) and its padding after it. The prefill writes the padding's
    keys into slots that the row's own generated tokens overwrite before any query can see
    them (a query at position ``p`` sees slots ``<= p``), so no attention mask is needed and
    the result is the model's distribution exactly as a single unpadded row would see it.

    Equal prompts (a GRPO group's G rows) are prefilled once and their cache rows copied over
    the rows that continue them; finished rows leave the batch once they are half of it; with
    ``compile`` the decode step runs ``torch.compile``d (:mod:`tunelab.rl.decoding`). None of
    these changes a token: each row's computation does not depend on its neighbours.

    With ``gather_once`` (the default) each FSDP2 group is all-gathered once per ``generate``
    call, at the prefill, and held until the last token
    (:func:`~tunelab.distributed.hold_gathered`): every rank then holds the whole model while
    it generates, its decode forwards run no collective, and each rank stops when its own
    sequences have (no per-token synchronisation). Without it every forward gathers the shards
    block by block, as a training forward does (one all-gather per block per token, and only
    about one block gathered at a time), so every rank must run the same forwards: the ranks
    agree (one all-reduce per token) to stop only once every sequence of every rank has
    stopped; so do models whose forward communicates anyway (tensor or expert parallelism).

    With ``merge_adapters`` (the default) and the weights whole for the call (one process, or
    ``gather_once``), each LoRA/DoRA layer runs one linear with ``W + scale * B A`` merged on
    entry into a temporary copy (:func:`~tunelab.peft.merged_adapters`: the live weights are
    untouched; an NF4 base stays unmerged). The merged forward equals the adapted one up to
    rounding, so a token may differ from the unmerged path's where two are nearly tied; the
    choice is deterministic, so a resumed run samples the same tokens.

    With ``pack_weights`` (the default) and an eager decode step, every fp32 linear weight on
    CPU runs packed for oneDNN for the call (:func:`~tunelab.modules.packed_linear.packed_linears`:
    merged adapters in place of their merged copy, plain layers with a packed copy; at a decode
    step's few dozen rows 5-35% less time per matmul than MKL's sgemm here). It changes
    rounding only, like the merge.

    Prompts with images (``images``, a vision-language model) are prefilled as the training
    forward reads them: the vision tower runs once per distinct prompt (rows sharing one pass
    the same images object), its features in the image tokens, M-RoPE positions (Qwen: the
    decoded tokens continue after the prompt's largest position, as transformers' generation
    does) or Gemma 3's bidirectional image blocks; then text is decoded as for any prompt. A
    vision-language model never samples its image or video token, which the training forward
    would take for an image or a video: it is drawn from the other tokens (the recorded log-probs and the
    entropy stay the model's own, as the trainer computes them).

    After each call, ``last_generation_seconds``, ``last_generated_tokens``,
    ``last_entropy_sum`` (the policy's entropy summed over the sampled positions) and
    ``last_logps`` (each sampled token's log-prob at temperature 1: the behaviour log-probs of
    :mod:`tunelab.rl.off_policy`) describe it.

    Args:
        model: A ``TransformerDecoder`` (plain or FSDP2-sharded), the policy.
        settings: How to sample.
        pad_id: Token that fills short prompts (never seen by a query).
        decode: Token ids to text, for ``stop_strings`` (the tokenizer's ``decode``).
        gather_once: Hold the FSDP2-gathered parameters for the whole call (see above).
        merge_adapters: Merge LoRA adapters into temporary weights for the call (see above).
        compile: ``torch.compile`` the decode step (see above).
        pack_weights: Run the linear layers on oneDNN-packed weights for the call (CPU, fp32,
            eager decode step; see above).

    Before it allocates anything, each call checks its lengths (:meth:`check_lengths`): the
    longest prompt plus ``max_new_tokens`` must fit the model's context, and the KV cache must
    fit the memory free on the device.

    Raises:
        ValueError: ``stop_strings`` without ``decode``.
    """

    def __init__(
        self,
        model: nn.Module,
        settings: SamplingSettings,
        *,
        pad_id: int,
        decode: Callable[[list[int]], str] | None = None,
        gather_once: bool = True,
        merge_adapters: bool = True,
        compile: bool = False,
        pack_weights: bool = True,
    ) -> None:
        if settings.stop_strings and decode is None:
            raise ValueError("stop_strings need the tokenizer's decode")
        self.model = model
        self.settings = settings
        self.pad_id = pad_id
        self.decode = decode
        self.gather_once = gather_once
        self.merge_adapters = merge_adapters
        self.compile = compile
        self.pack_weights = pack_weights
        self.last_generation_seconds = 0.0
        self.last_generated_tokens = 0
        self.last_entropy_sum = 0.0
        self.last_logps: list[list[float]] = []
        pixel_tokens = [
            token
            for token in getattr(model, "pixel_token_ids", ())
            if token < model.args.vocab_size
        ]
        self.banned_ids = torch.tensor(pixel_tokens) if pixel_tokens else None

    @classmethod
    def from_rollout(
        cls, model: nn.Module, rollout: RolloutArgs, tokenizer: Any
    ) -> ModelRolloutEngine:
        """The engine a recipe's ``rollout`` section describes, taken whole.

        Args:
            model: The policy.
            rollout: The ``rollout`` settings: lengths, sampling, stop strings, and
                ``gather_once`` / ``merge_adapters``.
            tokenizer: Gives the stop tokens, the padding token and ``decode``.
        """
        settings = SamplingSettings(
            max_new_tokens=rollout.max_new_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            stop_ids=frozenset(tokenizer.stop_ids),
            stop_strings=tuple(rollout.stop_strings or ()),
        )
        return cls(
            model,
            settings,
            pad_id=tokenizer.pad_id,
            decode=tokenizer.decode,
            gather_once=rollout.gather_once,
            merge_adapters=rollout.merge_adapters,
            compile=rollout.compile,
        )

    def update_weights(self, model: nn.Module) -> None:
        """Nothing to do: the engine samples from the live model."""

    def kv_cache_bytes(self, rows: int, length: int) -> int:
        """Bytes of the KV cache :meth:`generate` allocates for ``rows`` sequences of ``length``.

        Every block holds keys and values ``[rows, num_kv_heads, length, head_dim]`` in the
        embedding's dtype (``TransformerDecoder.setup_caches``).
        """
        args = self.model.args
        element = self.model.model.embed_tokens.weight.element_size()
        return rows * length * args.num_layers * 2 * args.num_kv_heads * args.head_dim * element

    def check_lengths(self, rows: int, prompt_tokens: int) -> None:
        """Refuse a generation the model's context or the device's memory cannot take.

        Called before anything is allocated, so ``max_new_tokens=1000000000`` is one line with
        the number and the settings to change, not an allocation of terabytes.

        Args:
            rows: Sequences generated together (``batch_size x num_generations`` in training).
            prompt_tokens: The longest prompt.

        Raises:
            ConfigError: The prompt and ``max_new_tokens`` exceed ``max_position_embeddings``,
                or the KV cache is larger than the memory this process may use
                (:func:`~tunelab.distributed.frozen_base.memory_budget_bytes`, plus what
                torch's CUDA allocator holds unused).
        """
        new_tokens = self.settings.max_new_tokens
        args = self.model.args
        length = prompt_tokens + new_tokens
        if length > args.max_seq_len:
            raise ConfigError(
                f"a prompt of {prompt_tokens} tokens + max_new_tokens {new_tokens} = {length} "
                f"exceed the model's context (max_position_embeddings {args.max_seq_len}); "
                "lower max_new_tokens or dataset.max_prompt_tokens"
            )
        device = self.model.model.embed_tokens.weight.device
        needed = self.kv_cache_bytes(rows, length)
        free = memory_budget_bytes(device)
        if device.type == "cuda":  # blocks torch holds but does not use are free to it
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if needed > free:
            element = self.model.model.embed_tokens.weight.element_size()
            raise ConfigError(
                f"generating needs {needed / 2**30:.1f} GiB for the KV cache ({rows} sequences "
                f"(schedule.batch_size x rollout.num_generations) x ({prompt_tokens} prompt + {new_tokens} new "
                f"tokens) x {args.num_layers} layers x 2 x {args.num_kv_heads} KV heads x "
                f"{args.head_dim} x {element} bytes), more than the {free / 2**30:.1f} GiB "
                f"free for this process on {device}; lower rollout.max_new_tokens, "
                "schedule.batch_size or rollout.num_generations (or dataset.max_prompt_tokens)"
            )

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        images: Sequence[PromptImages | None] | None = None,
    ) -> list[list[int]]:
        """Sample one completion per prompt (see :class:`RolloutEngine`)."""
        start = time.perf_counter()
        model, settings = self.model, self.settings
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("every prompt needs at least one token")
        device = model.model.embed_tokens.weight.device
        rows = len(prompts)
        width = max(len(prompt) for prompt in prompts)
        self.check_lengths(rows, width)
        # Equal prompts (a GRPO group's G rows) are prefilled once; their rows copy its cache.
        unique, of_row = distinct_prompts(prompts, images)
        tokens = torch.full((len(unique), width), self.pad_id, dtype=torch.long)
        for index, prompt in enumerate(unique):
            tokens[index, : len(prompt)] = torch.tensor(prompt)
        tokens = tokens.to(device)
        unique_lengths = torch.tensor([len(prompt) for prompt in unique], device=device)
        of_row_index = torch.tensor(of_row, device=device)
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        step_fn = DecodeStep(model, self.compile)
        batch = DecodeBatch(unique_lengths[of_row_index], generators, step_fn.compiled)
        was_training = model.training
        model.eval()  # no adapter dropout while sampling
        cache_length = bucket_length(width + settings.max_new_tokens, step_fn.compiled)
        model.setup_caches(len(unique), cache_length, device=device)
        out = torch.full((rows, settings.max_new_tokens), self.pad_id, dtype=torch.long)
        out_logps = torch.zeros((rows, settings.max_new_tokens), dtype=torch.float32)
        out_lengths = torch.zeros(rows, dtype=torch.long)
        stop_ids = torch.tensor(sorted(settings.stop_ids), dtype=torch.long)
        held = contextlib.nullcontext()
        if self.gather_once:
            held = hold_gathered(model, gather_now=self.merge_adapters)
        merged = merged_adapters(model) if self.merge_adapters else contextlib.nullcontext()
        packed = contextlib.nullcontext()
        if self.pack_weights and not step_fn.compiled:  # inductor takes no packed weights
            packed = packed_linears(model, rows)
        try:
            with held, merged, packed:
                positions = torch.arange(width, device=device).expand(len(unique), width)
                vision = _prefill_images(images, of_row, device)
                hidden = model(tokens, input_pos=positions, return_hidden=True, **vision)
                last = hidden[torch.arange(len(unique), device=device), unique_lengths - 1]
                logits = model.output(last)[of_row_index]
                for layer in model.layers:
                    layer.self_attn.kv_cache.select_rows(of_row_index)
                # Held gathered (or one process), a decode forward is local: each rank stops
                # when its own rows do, with no per-token all-reduce holding it to the others.
                lockstep = forwards_communicate(model)
                entropy = torch.zeros((), dtype=torch.float64, device=device)
                for step in range(settings.max_new_tokens):
                    # The policy's entropy at each sampled position (before temperature and
                    # filtering): a collapsing entropy is the first sign of a policy gone greedy.
                    log_probs = torch.log_softmax(logits.float(), dim=-1)
                    row_entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
                    entropy += row_entropy.masked_fill(batch.done.to(device), 0.0).double().sum()
                    live = ~batch.done
                    if self.banned_ids is not None:  # drawn from the rest; log-probs unchanged
                        banned = self.banned_ids.to(device)
                        logits = logits.index_fill(-1, banned, float("-inf"))
                    next_tokens = sample_tokens(logits, settings, batch.generators, live.tolist())
                    sampled = next_tokens.cpu()
                    out[batch.rows[live], step] = sampled[live]
                    chosen = behaviour_logps_of(log_probs, next_tokens)
                    out_logps[batch.rows[live], step] = chosen[live]
                    out_lengths[batch.rows[live]] = step + 1
                    finished = live & torch.isin(sampled, stop_ids)
                    if settings.stop_strings:
                        for slot in (live & ~finished).nonzero()[:, 0].tolist():
                            row = int(batch.rows[slot])
                            finished[slot] = self._stops(out[row, : step + 1].tolist())
                    batch.done |= finished
                    remaining = int((~batch.done).sum())
                    if step == settings.max_new_tokens - 1 or _all_done(remaining, lockstep):
                        break
                    (next_tokens,) = batch.compact(model, next_tokens)
                    logits = step_fn(next_tokens[:, None], (batch.positions + step)[:, None])
        finally:
            model.teardown_caches()
            model.train(was_training)
            # No-grad forwards leave the root's parameters gathered; the optimizer edits shards.
            reshard_all(model)
        completions = [row[:length] for row, length in zip(out.tolist(), out_lengths.tolist())]
        self.last_logps = [
            row[:length] for row, length in zip(out_logps.tolist(), out_lengths.tolist())
        ]
        self.last_generation_seconds = time.perf_counter() - start
        self.last_generated_tokens = sum(len(c) for c in completions)
        self.last_entropy_sum = float(entropy)
        return completions

    def _stops(self, completion: list[int]) -> bool:
        # A stop string anywhere in the completion's text ends it (the whole text is decoded:
        # a string may span tokens, and decoding is cheap next to a forward at these lengths).
        text = self.decode(completion)
        return any(stop in text for stop in self.settings.stop_strings)


def _prefill_images(
    images: Sequence[PromptImages | None] | None, of_row: list[int], device: torch.device
) -> dict[str, torch.Tensor]:
    """The prefill's image arguments: each distinct prompt's images once, in prompt order."""
    if images is None:
        return {}
    first = {}
    for row, index in enumerate(of_row):
        first.setdefault(index, row)
    chosen = [images[first[index]] for index in range(len(first))]
    chosen = [item for item in chosen if item is not None]
    if not chosen:
        return {}
    return {key: torch.cat([item[key] for item in chosen]).to(device) for key in chosen[0]}


def _all_done(remaining: int, lockstep: bool) -> bool:
    # With ``lockstep`` every rank runs the same number of forwards (their collectives):
    # stop together.
    if lockstep and dist.is_initialized() and dist.get_world_size() > 1:
        total = torch.tensor(float(remaining), dtype=torch.float64)
        dist.all_reduce(total)
        remaining = int(total)
    return remaining == 0
