"""Multi-turn episodes, token in and token out: the policy's tokens are never encoded again.

An episode's sequence is its prompt (the chat template's render of the prompt messages and
the tools, with the generation prompt), then turns. A turn is the policy's reply (its sampled
tokens, kept as they are: trained), then, when the reply calls tools, the tools' results in
the chat template's format (template and tool tokens: never trained). The reply's text is
decoded only to parse its calls; the sequence keeps the sampled ids.

The tokens after a reply are a delta of two renders of the conversation with the
generation prompt: ``before`` (up to the reply) and ``after`` (with the parsed reply and the
tool messages); the delta is what ``after`` adds past the reply's end-of-turn marker (the
first stop token's text after ``before``), encoded on its own. When the policy wrote the reply
as the template would have rendered it, the episode's ids equal the template's render of the
whole conversation (tests check it against ``transformers`` for Qwen3 and Llama 3.1). A
template that rewrites earlier turns when the conversation grows (``after`` does not start
with ``before``: Qwen3 with ``enable_thinking: false``, or when a new user turn drops old
``<think>`` blocks) ends the episode there (stop reason ``template_rewrite``), since the
cached sequence can no longer be the template's render.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tunelab.config.agentic_section import AgenticArgs
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError
from tunelab.errors import ConfigError
from tunelab.rl.agentic.environments import checked_reward
from tunelab.rl.agentic.tool_calls import detect_format, parse_assistant
from tunelab.rl.agentic.tool_processes import ToolExecutor
from tunelab.rl.agentic.toolbox import EpisodeTools, Toolbox
from tunelab.rl.agentic.tools import ToolCall, ToolResult
from tunelab.rl.agentic.turn_sampler import CachedTurnSampler, any_rank
from tunelab.rl.decoding import forwards_communicate
from tunelab.rl.rollout import ModelRolloutEngine

__all__ = [
    "CUT_MARKER",
    "STOP_REASONS",
    "Episode",
    "EpisodeLimits",
    "EpisodeRunner",
    "cut_tool_result",
    "episode_batch",
    "episode_prompt",
]

STOP_REASONS = (
    "answer",
    "max_turns",
    "max_tool_calls",
    "max_episode_tokens",
    "max_new_tokens",
    "template_rewrite",
    "template_error",
)
"""Why an episode ended (``Episode.stop_reason``; ``agentic/stop/<reason>`` counts them)."""

CUT_MARKER = " [...]"
"""Ends a tool result cut to ``max_tool_result_chars`` or ``max_tool_result_tokens``."""


@dataclass(frozen=True)
class EpisodeLimits:
    """Bounds of one episode.

    Attributes:
        max_turns: Policy replies at most.
        max_tool_calls: Tool calls at most (a reply that would pass it ends the episode).
        max_episode_tokens: Tokens after the prompt at most (replies, template and tools).
        tool_timeout_s: Seconds one tool call may take; past it the call is a ``timeout``
            error (a plain function's worker process is killed; see ``tool_processes``).
        max_tool_result_chars: A tool result is cut to this many characters.
        max_tool_result_tokens: ... and to this many tokens, :data:`CUT_MARKER` included.
        tool_processes: Worker processes for plain function tools (0: threads).
    """

    max_turns: int = 4
    max_tool_calls: int = 8
    max_episode_tokens: int = 256
    tool_timeout_s: float = 10.0
    max_tool_result_chars: int = 2000
    max_tool_result_tokens: int = 256
    tool_processes: int = 2


@dataclass
class Episode:
    """One rolled-out episode.

    Attributes:
        prompt_tokens: The prompt's ids.
        tokens: The ids after the prompt: replies and tool deltas, in order.
        trained: Per id of ``tokens``: True where the policy sampled it (the loss's
            positions), False for template and tool tokens.
        logps: Per id of ``tokens``: the behaviour policy's log-prob of a sampled id (recorded
            while sampling, ``CachedTurnSampler.last_logps``), 0.0 for template and tool
            tokens (never trained, so never weighed); None when the sampler records none.
        messages: The whole conversation (prompt, parsed replies, tool results).
        tools: The JSON schemas the prompt offered.
        environment: The environment's class name ('' for none).
        num_turns: Replies.
        num_tool_calls: Tool calls made.
        tool_errors: Failed calls by kind (``unknown_tool``, ``bad_arguments``, ...).
        tool_results_cut: Results cut to the limits (:data:`CUT_MARKER` at their end).
        tool_seconds: Wall time in this episode's tool calls.
        stop_reason: ``answer`` (a reply without calls), ``max_turns``, ``max_tool_calls``,
            ``max_episode_tokens``, ``max_new_tokens`` (a reply without a stop token),
            ``template_rewrite`` or ``template_error``.
        environment_reward: The environment's ``reward()``, or None.
    """

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    logps: list[float] | None = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    environment: str = ""
    num_turns: int = 0
    num_tool_calls: int = 0
    tool_errors: Counter = field(default_factory=Counter)
    tool_results_cut: int = 0
    tool_seconds: float = 0.0
    stop_reason: str = ""
    environment_reward: float | None = None

    def record(self) -> dict[str, Any]:
        """The episode as ``completions.jsonl`` writes it (messages with their roles)."""
        return {
            "messages": self.messages,
            "environment": self.environment,
            "num_turns": self.num_turns,
            "num_tool_calls": self.num_tool_calls,
            "tool_errors": dict(self.tool_errors),
            "tool_results_cut": self.tool_results_cut,
            "stop_reason": self.stop_reason,
            "environment_reward": self.environment_reward,
        }


def episode_batch(
    episodes: Sequence[Episode], pad_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Training rows of episodes: labels only at the policy's own tokens.

    Returns:
        ``tokens`` and ``labels`` ``[rows, longest]``: ``labels`` holds the sampled ids where
        ``trained`` and -100 on the prompt, template and tool tokens and padding, so the
        policy loss (``tunelab.rl.completion_logps``) counts exactly the policy's tokens.
    """
    width = max(len(e.prompt_tokens) + len(e.tokens) for e in episodes)
    tokens = torch.full((len(episodes), width), pad_id, dtype=torch.long)
    labels = torch.full((len(episodes), width), -100, dtype=torch.long)
    for row, episode in enumerate(episodes):
        ids = episode.prompt_tokens + episode.tokens
        tokens[row, : len(ids)] = torch.tensor(ids)
        start = len(episode.prompt_tokens)
        for offset, (token, trained) in enumerate(
            zip(episode.tokens, episode.trained, strict=True)
        ):
            if trained:
                labels[row, start + offset] = token
    return {"tokens": tokens.to(device), "labels": labels.to(device)}


class _State:
    """An episode in progress: its record, its tools, and its last render."""

    def __init__(self, episode: Episode, tools: EpisodeTools, rendered: str) -> None:
        self.episode = episode
        self.tools = tools
        self.rendered = rendered  # the conversation so far, with the generation prompt
        self.next_tokens: list[int] | None = episode.prompt_tokens
        self.done = False


class EpisodeRunner:
    """Rolls out many episodes at once: batched replies, tools in parallel, one KV cache.

    Args:
        sampler: Samples the replies (the cache is kept across turns).
        tokenizer: A ``tunelab.data.Tokenizer`` (``encode``, ``decode``, ``stop_ids``).
        template: The chat template the prompts and tool results are rendered with.
        toolbox: The shared tools and environments.
        limits: The episode bounds.
        tool_format: ``auto`` (from the template) or one of ``tool_calls.FORMATS``.
        template_kwargs: Extra template variables.
        tool_workers: Episodes whose tools run at the same time.

    After each :meth:`run`, ``last_metrics`` holds its timings and counts.
    """

    def __init__(
        self,
        sampler: CachedTurnSampler,
        tokenizer: Any,
        template: ChatTemplate,
        toolbox: Toolbox,
        limits: EpisodeLimits,
        *,
        tool_format: str = "auto",
        template_kwargs: Mapping[str, Any] | None = None,
        tool_workers: int = 8,
    ) -> None:
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.template = template
        self.toolbox = toolbox
        self.limits = limits
        self.tool_format = detect_format(template.text) if tool_format == "auto" else tool_format
        self.template_kwargs = dict(template_kwargs or {})
        self.tool_workers = tool_workers
        self.executor = ToolExecutor(
            limits.tool_timeout_s, limits.tool_processes, limits.max_tool_result_chars
        )
        self.stop_texts = sorted(
            {tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.stop_ids} - {""}
        )
        self.last_metrics: dict[str, float] = {}
        self.settings: AgenticArgs | None = None

    @classmethod
    def from_settings(
        cls, engine: ModelRolloutEngine, tokenizer: Any, agentic: AgenticArgs
    ) -> EpisodeRunner:
        """The runner of a recipe's ``agentic`` section, taken whole (kept as ``settings``).

        Args:
            engine: The single-turn engine: its model, sampling settings (``rollout.*``),
                padding and FSDP2/adapter choices.
            tokenizer: Its chat template renders the episodes.
            agentic: The ``agentic`` section.
        """
        sampler = CachedTurnSampler(
            engine.model, engine.settings, pad_id=engine.pad_id,
            gather_once=engine.gather_once, merge_adapters=engine.merge_adapters,
        )  # fmt: skip
        limits = EpisodeLimits(
            max_turns=agentic.max_turns,
            max_tool_calls=agentic.max_tool_calls,
            max_episode_tokens=agentic.max_episode_tokens,
            tool_timeout_s=agentic.tool_timeout_s,
            max_tool_result_chars=agentic.max_tool_result_chars,
            max_tool_result_tokens=agentic.max_tool_result_tokens,
            tool_processes=agentic.tool_processes,
        )
        if tokenizer.chat_template is None:
            raise ConfigError(
                f"agentic episodes need a chat template: {tokenizer.no_chat_template_reason} "
                "(set tokenizer.chat_template)"
            )
        runner = cls(
            sampler,
            tokenizer,
            tokenizer.chat_template,
            Toolbox.from_nodes(agentic.tools, agentic.environments),
            limits,
            tool_format=agentic.tool_format,
            template_kwargs=agentic.template_kwargs,
            tool_workers=agentic.tool_workers,
        )
        runner.settings = agentic
        return runner

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        return self.template.render(
            messages, add_generation_prompt=True, tools=tools or None,
            template_kwargs=self.template_kwargs,
        )  # fmt: skip

    def start(self, messages: list[dict[str, Any]], row: Mapping[str, Any], seed: int) -> _State:
        """An episode's start: its environment reset, its prompt rendered and encoded.

        Raises:
            ConfigError: A broken environment, or a prompt the chat template refuses.
        """
        messages, tools, rendered = episode_prompt(
            self.template, self.toolbox, messages, row, seed, self.template_kwargs
        )
        episode = Episode(
            self.tokenizer.encode(rendered, add_bos=False),
            messages=messages,
            tools=tools.schemas,
            environment=tools.environment_name,
        )
        return _State(episode, tools, rendered)

    def run(
        self,
        prompts: Sequence[tuple[list[dict[str, Any]], Mapping[str, Any]]],
        seeds: Sequence[int],
    ) -> list[Episode]:
        """Roll out one episode per ``(messages, row)``, each from its seed.

        The seed drives both the episode's sampling and its environment (``reset``), so the
        same seed gives the same episode, tool calls and results included. A collective only
        where forwards communicate (FSDP2 shards not held gathered: every rank calls it, with
        its own prompts, and they take the same turns); otherwise local to this rank, so a
        worker thread or a rollout rank may run it beside other collectives (see
        :meth:`_another_turn`).

        Returns:
            The episodes, in the order of ``prompts``.
        """
        start_time = time.perf_counter()
        states = [
            self.start(messages, row, seed)
            for (messages, row), seed in zip(prompts, seeds, strict=True)
        ]
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        budget = self.limits.max_episode_tokens
        capacity = max((len(s.episode.prompt_tokens) for s in states), default=1) + budget
        model_context = self.sampler.model.args.max_seq_len
        if capacity > model_context:
            raise ConfigError(
                f"an episode of {capacity} tokens (its prompt + agentic.max_episode_tokens "
                f"{budget}) exceeds the model's context ({model_context}); lower "
                "agentic.max_episode_tokens or dataset.max_prompt_tokens"
            )
        generation_seconds = tool_seconds = 0.0
        with (
            self.sampler.session(len(states), capacity),
            ThreadPoolExecutor(self.tool_workers) as pool,
        ):
            while self._another_turn(states):
                turn_start = time.perf_counter()
                limits = [
                    0
                    if s.done
                    else min(self.sampler.settings.max_new_tokens, budget - len(s.episode.tokens))
                    for s in states
                ]
                replies = self.sampler.turn(
                    [None if s.done else s.next_tokens for s in states], generators, limits
                )
                generation_seconds += time.perf_counter() - turn_start
                # A sampler that records no log-probs (a replayed policy) leaves them None.
                recorded = getattr(self.sampler, "last_logps", None) or [None] * len(states)
                tool_start = time.perf_counter()
                calls = {
                    i: self._take_reply(s, reply, logps)
                    for i, (s, reply, logps) in enumerate(
                        zip(states, replies, recorded, strict=True)
                    )
                    if not s.done
                }
                futures = {
                    i: pool.submit(self._run_calls, states[i], found)
                    for i, found in calls.items()
                    if found
                }
                for i, future in futures.items():
                    self._add_results(states[i], calls[i], future.result())
                tool_seconds += time.perf_counter() - tool_start
        for state in states:
            if state.tools.environment is not None:
                state.episode.environment_reward = checked_reward(
                    state.tools.environment, state.tools.environment_name
                )
        episodes = [state.episode for state in states]
        self.last_metrics = {
            "generation_seconds": generation_seconds,
            "tool_seconds": tool_seconds,
            "episode_seconds": time.perf_counter() - start_time,
            "prefill_tokens": float(self.sampler.prefill_tokens),
            "generated_tokens": float(self.sampler.generated_tokens),
            "entropy_sum": self.sampler.entropy_sum,
        }
        return episodes

    def _another_turn(self, states: Sequence[_State]) -> bool:
        """Whether to take another turn: while this rank's episodes go on, or any rank's.

        Where a forward runs collectives (a parameter still a ``DTensor``: FSDP2 shards not
        held gathered, tensor parallelism), every rank must run the same forwards, so the
        ranks agree over the default group (one all-reduce per turn) and take turns until
        every rank's episodes ended. Where forwards are local (one process, FSDP2 held
        gathered, a whole copy on a sampling thread or a rollout rank, which has no default
        group), this rank stops when its own episodes do and runs no collective. Decided
        each turn from the model as it stands: every rank holds it alike, so they agree.
        """
        going_on = any(not s.done for s in states)
        return any_rank(going_on) if forwards_communicate(self.sampler.model) else going_on

    def _take_reply(
        self, state: _State, reply: list[int], logps: list[float] | None
    ) -> list[ToolCall]:
        """Append a reply (and its recorded log-probs); the calls to run, or [] (and ``done``)."""
        episode = state.episode
        episode.tokens += reply
        episode.trained += [True] * len(reply)
        if logps is None or episode.logps is None:
            episode.logps = None
        else:
            episode.logps += logps
        episode.num_turns += 1
        stopped = bool(reply) and reply[-1] in self.tokenizer.stop_ids
        text = self.tokenizer.decode(reply[:-1] if stopped else reply, skip_special_tokens=False)
        message, calls = parse_assistant(text, self.tool_format, episode.num_turns - 1)
        episode.messages.append(message)
        reason = ""
        if not stopped:
            full = len(episode.tokens) >= self.limits.max_episode_tokens
            reason = "max_episode_tokens" if full else "max_new_tokens"
        elif not calls:
            reason = "answer"
        elif episode.num_turns >= self.limits.max_turns:
            reason = "max_turns"
        elif episode.num_tool_calls + len(calls) > self.limits.max_tool_calls:
            reason = "max_tool_calls"
        if reason:
            episode.stop_reason, state.done = reason, True
            return []
        return calls

    def _run_calls(self, state: _State, calls: list[ToolCall]) -> list[ToolResult]:
        """An episode's calls in order (its environment sees them one at a time)."""
        return [self.executor.call(state.tools.tools, call) for call in calls]

    def _add_results(self, state: _State, calls: list[ToolCall], results: list[ToolResult]) -> None:
        """Append the tool messages and the template's delta (untrained) to the sequence."""
        episode = state.episode
        for call, result in zip(calls, results, strict=True):
            episode.num_tool_calls += 1
            episode.tool_seconds += result.seconds
            if result.error is not None:
                episode.tool_errors[result.error] += 1
            content, cut = cut_tool_result(result.content, self.limits, self.tokenizer)
            episode.tool_results_cut += cut
            episode.messages.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}
            )
        try:
            after = self._render(episode.messages, episode.tools)
        except ChatTemplateError:
            episode.stop_reason, state.done = "template_error", True
            return
        delta = _delta_text(state.rendered, after, self.stop_texts)
        if delta is None:
            episode.stop_reason, state.done = "template_rewrite", True
            return
        ids = self.tokenizer.encode(delta, add_bos=False)
        # The reply's stop token is fed with the delta; one more token must fit to reply.
        if len(episode.tokens) + len(ids) + 1 > self.limits.max_episode_tokens:
            episode.stop_reason, state.done = "max_episode_tokens", True
            return
        episode.tokens += ids
        episode.trained += [False] * len(ids)
        if episode.logps is not None:  # never trained: any value, masked out of the loss
            episode.logps += [0.0] * len(ids)
        state.rendered, state.next_tokens = after, ids


def cut_tool_result(content: str, limits: EpisodeLimits, tokenizer: Any) -> tuple[str, bool]:
    """A tool result within ``max_tool_result_chars`` and ``max_tool_result_tokens``.

    Args:
        content: The tool's message (a result or an error).
        limits: The episode bounds.
        tokenizer: Counts the tokens (``encode``, ``decode``).

    Returns:
        The text, ending with :data:`CUT_MARKER` where cut (the marker counted in both
        limits), and whether it was cut.
    """
    cut = len(content) > limits.max_tool_result_chars
    if cut:
        content = content[: max(limits.max_tool_result_chars - len(CUT_MARKER), 0)] + CUT_MARKER
    ids = tokenizer.encode(content, add_bos=False)
    if len(ids) <= limits.max_tool_result_tokens:
        return content, cut
    # A merge across the cut may change the count: shorten until the marked text fits.
    kept = limits.max_tool_result_tokens - len(tokenizer.encode(CUT_MARKER, add_bos=False))
    while True:
        text = tokenizer.decode(ids[: max(kept, 0)], skip_special_tokens=False) + CUT_MARKER
        if kept <= 0 or len(tokenizer.encode(text, add_bos=False)) <= limits.max_tool_result_tokens:
            return text, True
        kept -= 1


def episode_prompt(
    template: ChatTemplate,
    toolbox: Toolbox,
    messages: Sequence[dict[str, Any]],
    row: Mapping[str, Any],
    seed: int,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], EpisodeTools, str]:
    """The prompt an episode starts from (what ``tunelab data preview`` shows of agentic configs).

    The row's environment is built and reset from ``seed``; what ``reset`` returns is added to
    the last user message; the messages are rendered with the episode's tools (their schemas)
    and the generation prompt.

    Returns:
        ``(messages, tools, text)``.

    Raises:
        ConfigError: A broken environment, or a prompt the chat template refuses.
    """
    tools = toolbox.start(row, seed)
    messages = copy.deepcopy(list(messages))
    if tools.added_prompt:
        last = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        messages[last]["content"] = f"{messages[last]['content']}\n\n{tools.added_prompt}"
    try:
        text = template.render(
            messages, add_generation_prompt=True, tools=tools.schemas or None,
            template_kwargs=template_kwargs,
        )  # fmt: skip
    except ChatTemplateError as error:
        raise ConfigError(f"the chat template refuses an episode's prompt: {error}") from None
    return messages, tools, text


def _delta_text(before: str, after: str, stop_texts: Sequence[str]) -> str | None:
    """What ``after`` adds past the reply's end-of-turn marker, or None (a rewritten prefix)."""
    if not after.startswith(before):
        return None
    rest = after[len(before) :]
    ends = [rest.find(text) + len(text) for text in stop_texts if text in rest]
    return rest[min(ends) :] if ends else None
