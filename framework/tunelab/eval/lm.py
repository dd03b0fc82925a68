"""lm-evaluation-harness's ``LM`` on tunelab's own model, tokenizer and KV-cache generation.

EleutherAI's harness asks a model three things (``lm_eval.api.model.LM``):

- ``loglikelihood(context, continuation)``: ``sum_t log p(cont_t | context, cont_<t)`` and
  whether every continuation token is the argmax;
- ``loglikelihood_rolling(text)``: the whole text's log-likelihood, in windows of the model's
  length;
- ``generate_until(context, gen_kwargs)``: a greedy completion cut at the first stop string.

:class:`TunelabLM` answers them with the tunelab model (plain or FSDP2-sharded, LoRA adapters
on or merged) and tokenizer, and no transformers model. Requests are sorted by length and
batched, so a batch holds rows of similar length; rows whose model input is the same token
sequence (the choices of a multiple-choice question whose answers are one token) share one
row. Only the continuation's positions go through the output layer: the ``[batch, seq,
vocab]`` logits never exist, and a prompt of 1,000 tokens with a one-token answer costs one
row of logits, not 1,000.

Tokenization follows lm-eval's ``hf`` backend exactly (so the numbers are the ones reported
for the same model there): text is encoded with the tokenizer's own BOS rule, a context that
already starts with the BOS text gets no second one, an empty context is the BOS (or EOS)
token, and a trailing space of the context moves to the continuation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tunelab.data import Tokenizer
from tunelab.errors import ConfigError
from tunelab.eval import _collectives
from tunelab.eval._lm_eval import (
    Instance,
    TemplateLM,
    get_rolling_token_windows,
    handle_stop_sequences,
    make_disjoint_window,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tunelab.rl import ModelRolloutEngine, SamplingSettings

__all__ = ["TunelabLM"]

# Logits computed at once when scoring continuations: 2**24 values (64 MiB in fp32), the
# chunk size of tunelab's chunked losses.
_CHUNK_LOGITS = 2**24

# One scoring request: ((context, continuation) strings or None, context ids, continuation ids).
_Request = tuple[tuple[str, str] | None, list[int], list[int]]


class TunelabLM(TemplateLM):
    """An lm-eval model backed by a tunelab ``TransformerDecoder`` and ``Tokenizer``.

    Pass it to ``lm_eval.simple_evaluate(model=...)`` (or :func:`tunelab.eval.evaluate`).
    With ``torch.distributed`` initialised it reports the process group's rank and size, so
    lm-eval gives each rank its share of every task's documents and gathers the results on
    rank 0; every rank runs the same number of forwards (FSDP2 needs it).

    Args:
        model: The model, in eval mode (plain or FSDP2-sharded).
        tokenizer: Its tokenizer.
        batch_size: Rows per forward (scoring) and sequences decoded together (generation).
        max_length: Longest model input in tokens (None: the model's ``max_seq_len``, HF's
            ``max_position_embeddings``); longer inputs lose tokens from the left, as in lm-eval.
        max_gen_toks: Tokens generated at most when a task does not say.
        name: A name for the tokenizer in lm-eval's request caches and results.
        seed: Seed of sampled generations (tasks asking ``do_sample: true``).

    Raises:
        ConfigError: ``batch_size`` or ``max_length`` below 1.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        name: str = "tunelab",
        seed: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length or int(model.args.max_seq_len)
        if self.max_length < 1:
            raise ConfigError(f"max_length must be at least 1, got {self.max_length}")
        self.max_gen_toks = max_gen_toks
        self.name = name
        self.seed = seed
        self._rank, self._world_size = _collectives.world()
        self._device = model.model.embed_tokens.weight.device
        self._bos_text = self.tok_decode([self.prefix_token_id], skip_special_tokens=False)

    # ---- what lm-eval reads ----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        """The end-of-text id (EOS)."""
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context stands for: BOS, or EOS for a tokenizer without one."""
        bos = self.tokenizer.bos_id
        return self.tokenizer.eos_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name in lm-eval's caches (no path separators)."""
        return self.name.replace("/", "__")

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Encode text as lm-eval's ``hf`` backend does.

        Args:
            string: The text.
            add_special_tokens: Add BOS (by the tokenizer's rule); None: add it unless the text
                already starts with the BOS text (a chat-templated prompt).
            left_truncate_len: Keep at most this many tokens, from the right.
            **kwargs: Ignored (lm-eval passes backend-specific options).

        Returns:
            The token ids.
        """
        if add_special_tokens is None:
            add_special_tokens = not (self._bos_text and string.startswith(self._bos_text))
        ids = self.tokenizer.encode(string, add_bos=add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode ids to text."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The chat template's text when one is asked for and the tokenizer has one."""
        if not chat_template or self.tokenizer.chat_template is None:
            return None
        return self.tokenizer.chat_template.text

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render a conversation with the tokenizer's own chat template (sandboxed Jinja).

        Without ``add_generation_prompt`` the last message is left open for the model to
        continue (transformers' ``continue_final_message``): the text ends where that message's
        content ends.

        Args:
            chat_history: The messages, ``{"role", "content"}`` dicts.
            add_generation_prompt: Open the assistant's reply.

        Returns:
            The rendered prompt.

        Raises:
            ConfigError: The tokenizer has no chat template.
        """
        template = self.tokenizer.chat_template
        if template is None:
            raise ConfigError(
                f"apply_chat_template: {self.tokenizer.no_chat_template_reason}; evaluate "
                "without it, or give the tokenizer a chat template"
            )
        text = template.render(chat_history, add_generation_prompt=add_generation_prompt)
        if add_generation_prompt or not chat_history:
            return text
        # transformers' continue_final_message: cut after the last message's content.
        final = chat_history[-1]["content"]
        start = text.rfind(final.strip())
        if start < 0:
            return text
        if text[start : start + len(final.lstrip())] == final:
            return text[: start + len(final.lstrip())]
        return text[: start + len(final.strip())]

    # ---- collectives lm-eval's evaluator calls --------------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor, concatenated (stacked when 0-dim)."""
        return _collectives.all_gather_tensor(tensor)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's object, in rank order, on ``dst``."""
        return _collectives.gather_object(obj, dst)

    def barrier(self) -> None:
        """Wait for every rank."""
        _collectives.barrier()

    # ---- scoring ---------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[_Request], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Score each continuation given its context.

        Args:
            requests: ``(strings, context_ids, continuation_ids)`` per request; context and
                continuation are non-empty.
            disable_tqdm: Unused (no progress bar).
            **kwargs: Unused.

        Returns:
            ``(sum of the continuation's log-probs, whether each continuation token is the
            argmax)`` per request, in request order.
        """
        # The model input of a request: context + continuation without its last token, cut
        # from the left to max_length; its last len(continuation) positions predict it.
        inputs: dict[tuple[int, ...], list[int]] = {}
        for index, (_, context, continuation) in enumerate(requests):
            if not continuation or len(continuation) > self.max_length:
                raise ConfigError(
                    f"a continuation of {len(continuation)} tokens cannot be scored with "
                    f"max_length {self.max_length}"
                )
            tokens = tuple((context + continuation)[-(self.max_length + 1) :][:-1])
            inputs.setdefault(tokens, []).append(index)
        # Longest first: a batch's rows are of similar length (little padding), and a run out
        # of memory shows at the first batch.
        rows = sorted(inputs, key=lambda tokens: (-len(tokens), tokens))
        batches = [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for batch in self._same_count_on_every_rank(batches, filler=[(self.prefix_token_id,)]):
            hidden = self._hidden_states(batch)
            wanted = [
                (row, index) for row, tokens in enumerate(batch) for index in inputs.get(tokens, [])
            ]
            if not wanted:
                continue  # a placeholder batch
            scores = self._score(
                hidden, batch, [(row, requests[index][2]) for row, index in wanted]
            )
            for (_, index), score in zip(wanted, scores, strict=True):
                results[index] = score
                strings = requests[index][0]
                if strings is not None:
                    self.cache_hook.add_partial("loglikelihood", strings, score)
        assert all(result is not None for result in results)
        return results  # type: ignore[return-value]

    def _same_count_on_every_rank(self, batches: list[Any], filler: Any) -> list[Any]:
        """The batches, then placeholder ones until every rank has as many.

        The count is agreed on before any forward: a collective between two FSDP2 forwards
        of another rank would pair with its all-gathers and hang.
        """
        return batches + [filler] * (_collectives.max_over_ranks(len(batches)) - len(batches))

    @torch.no_grad()
    def _hidden_states(self, batch: list[tuple[int, ...]]) -> torch.Tensor:
        """Final hidden states ``[rows, longest, dim]`` of right-padded rows.

        Attention is causal, so the padding after a row never reaches the row's positions.
        """
        width = max(len(tokens) for tokens in batch)
        padded = torch.full((len(batch), width), self.tokenizer.pad_id, dtype=torch.long)
        for row, tokens in enumerate(batch):
            padded[row, : len(tokens)] = torch.tensor(tokens)
        return self.model(padded.to(self._device), return_hidden=True)

    @torch.no_grad()
    def _score(
        self,
        hidden: torch.Tensor,
        batch: list[tuple[int, ...]],
        wanted: list[tuple[int, list[int]]],
    ) -> list[tuple[float, bool]]:
        """Log-prob sums and greedy flags of continuations.

        The output layer sees only the continuations' positions, a chunk of rows at a time.
        """
        positions, targets = [], []
        for row, continuation in wanted:
            end = len(batch[row])
            positions += [
                row * hidden.shape[1] + end - len(continuation) + t
                for t in range(len(continuation))
            ]
            targets += continuation
        flat = hidden.reshape(-1, hidden.shape[-1])
        index = torch.tensor(positions, device=hidden.device)
        target = torch.tensor(targets, device=hidden.device)
        vocab = int(self.model.args.vocab_size)
        rows_per_chunk = max(1, _CHUNK_LOGITS // vocab)
        logps, greedy = [], []
        for start in range(0, len(positions), rows_per_chunk):
            piece = index[start : start + rows_per_chunk]
            logits = self.model.output(flat.index_select(0, piece))
            log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            chunk_target = target[start : start + rows_per_chunk]
            logps.append(log_probs.gather(-1, chunk_target[:, None]).squeeze(-1))
            greedy.append(logits.argmax(dim=-1) == chunk_target)
        token_logps = torch.cat(logps).double().cpu().tolist()
        token_greedy = torch.cat(greedy).cpu().tolist()
        scores, start = [], 0
        for _, continuation in wanted:
            stop = start + len(continuation)
            scores.append((float(sum(token_logps[start:stop])), all(token_greedy[start:stop])))
            start = stop
        return scores

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """Each text's log-likelihood, in disjoint windows of ``max_length``.

        lm-eval's rule: each token is predicted once, each window with as much context as fits.

        Args:
            requests: Instances whose ``args`` is ``(text,)``.
            disable_tqdm: Unused (no progress bar).

        Returns:
            The log-likelihood of each text.
        """
        windows: list[_Request] = []
        owners: list[int] = []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, list(context), list(continuation)))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logp, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logp
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ---- generation ------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Complete each context until a stop string, EOS or ``max_gen_toks``.

        Greedy unless the task asks ``do_sample`` (then temperature / top-p / top-k sampling,
        seeded per request). Requests with the same generation settings are sorted by length
        and decoded ``batch_size`` at a time with the model's KV cache
        (:class:`~tunelab.rl.ModelRolloutEngine`, no padding seen by any query).

        Args:
            requests: Instances whose ``args`` is ``(context, gen_kwargs)``.
            disable_tqdm: Unused (no progress bar).

        Returns:
            Each completion, cut before its first stop string.
        """
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(_settings_key(request.args[1]), []).append(index)
        # Every rank walks the same groups in the same order with the same number of batches:
        # generation runs one collective per token under FSDP2 (and to agree on stopping).
        counts: dict[str, int] = {}
        for rank_counts in _collectives.all_gather_object(
            {key: -(-len(indices) // self.batch_size) for key, indices in groups.items()}
        ):
            for key, count in rank_counts.items():
                counts[key] = max(counts.get(key, 0), count)
        results: list[str | None] = [None] * len(requests)
        for key in sorted(counts):
            settings = json.loads(key)
            engine, until = self._engine(settings)
            max_context = self.max_length - engine.settings.max_new_tokens
            if max_context < 1:
                raise ConfigError(
                    f"max_gen_toks {engine.settings.max_new_tokens} leaves no room for a "
                    f"context within max_length {self.max_length}"
                )
            indices = groups.get(key, [])
            encoded = {
                i: self.tok_encode(requests[i].args[0], left_truncate_len=max_context)
                for i in indices
            }
            order = sorted(indices, key=lambda i: (-len(encoded[i]), requests[i].args[0]))
            batches = [
                order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)
            ]
            batches += [[]] * (counts[key] - len(batches))
            for batch in batches:
                prompts = [encoded[i] for i in batch] or [[self.prefix_token_id]]
                seeds = [self.seed + i for i in batch] or [self.seed]
                completions = engine.generate(prompts, seeds)
                for i, completion in zip(batch, completions, strict=False):
                    text = postprocess_generated_text(self.tok_decode(completion), until, None)
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        assert all(result is not None for result in results)
        return results  # type: ignore[return-value]

    def _engine(self, gen_kwargs: dict[str, Any]) -> tuple[ModelRolloutEngine, list[str]]:
        """The decoding engine for one task's generation settings, and its stop strings."""
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        until = handle_stop_sequences(
            kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id], False)
        )
        sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0) > 0
        top_k = kwargs.get("top_k")
        settings = SamplingSettings(
            max_new_tokens=int(kwargs["max_gen_toks"]),
            temperature=float(kwargs["temperature"]) if sampled else 0.0,
            top_p=float(kwargs.get("top_p") or 1.0) if sampled else 1.0,
            top_k=int(top_k) if sampled and top_k else None,
            stop_ids=frozenset(self.tokenizer.stop_ids),
            stop_strings=tuple(stop for stop in until if stop),
        )
        decode: Callable[[list[int]], str] = self.tok_decode
        engine = ModelRolloutEngine(
            self.model, settings, pad_id=self.tokenizer.pad_id, decode=decode
        )
        return engine, until


def _settings_key(gen_kwargs: dict[str, Any]) -> str:
    # Generation settings as a canonical string: the groups are keyed and ordered by it.
    return json.dumps(gen_kwargs, sort_keys=True, default=str)
