"""A learned reward for GRPO: a reward-model folder scores whole completions.

The folder is an export of ``reward_model_distributed`` (or any hub
``*ForSequenceClassification`` model with one label): its weights are read as safetensors and
its ``config.json`` and tokenizer as JSON, after the folder's manifest checksums are verified
when it has one; nothing is unpickled. The reward model is loaded once per process, at the
first call (every rank calls the rewards at the same time, so the load's collectives match),
in its own dtype, frozen: replicated on every rank when it fits the memory budget, else
FSDP2-sharded over the ranks as a frozen reference is (``sharding``). Each completion is
rendered after its prompt with the reward model's own tokenizer and template, as the reward
model was trained, and scored in batches at its last token::

    rewards:
      functions:
        - _component_: tunelab.rl.learned_reward
          path: outputs/tiny_reward_model/epoch_0
          template: instruct
        - _component_: tunelab.rl.regex_reward
          pattern: "[0-9 ]+"
      weights: [1.0, 0.5]

The first call also loads the model: a large one may need ``rewards.timeout_s`` raised.
"""

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from tunelab.data import load_tokenizer
from tunelab.data.collate import padded_collate_sft
from tunelab.data.rows import to_messages
from tunelab.data.sft import resolve_template
from tunelab.data.templates import tokenize_messages
from tunelab.distributed import resolve_dtype, shard_model
from tunelab.distributed.frozen_base import choose_frozen_base
from tunelab.errors import CheckpointError
from tunelab.formats.integrity import MANIFEST_NAME, verify_folder
from tunelab.models import from_hf_config, load_hf_into_model
from tunelab.models.classifier import SCORE_HEAD, SequenceClassifier, sequence_scores

# Loaded reward models by their settings, one per process: loaded once, reused by every call.
_LOADED: dict[tuple, "_Scorer"] = {}


class _Scorer:
    """A frozen reward model with its tokenizer and template, on this process's device."""

    def __init__(
        self, path: Path, dtype: str, sharding: Literal["auto", "replicate", "shard"], template: str
    ) -> None:
        if (path / MANIFEST_NAME).is_file():
            problems = verify_folder(path)
            if problems:
                raise CheckpointError(f"reward model {path} fails verification: {problems[0]}")
        self.tokenizer = load_tokenizer(path)
        self.template = resolve_template(self.tokenizer, template, None)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        with torch.device("meta"):
            model = from_hf_config(path, SequenceClassifier)
            model.to(resolve_dtype(dtype))
        model.requires_grad_(False)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Every weight is frozen: "replicate" gathers them once and keeps them.
            shard_model(model, frozen_base=choose_frozen_base(sharding, model, device))
        model.to_empty(device=device)
        loaded = load_hf_into_model(model, path)
        if f"{SCORE_HEAD}.weight" in loaded.missing:
            raise CheckpointError(
                f"{path} has no {SCORE_HEAD}.weight: not a reward model (export one with "
                "reward_model_distributed)"
            )
        self.model = model.eval()
        self.device = device

    @torch.no_grad()
    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], batch_size: int
    ) -> list[float]:
        """The reward model's score of each completion after its prompt, in batches."""
        collate = partial(padded_collate_sft, pad_id=self.tokenizer.pad_id)
        samples = []
        for prompt, completion in zip(prompts, completions, strict=True):
            messages = to_messages([("user", prompt), ("assistant", completion)], False)
            tokens, _ = tokenize_messages(self.tokenizer, messages, self.template)
            limit = self.tokenizer.max_seq_len or self.model.args.max_seq_len
            samples.append({"tokens": tokens[:limit], "labels": tokens[:limit]})
        scores = []
        for start in range(0, len(samples), batch_size):
            tokens = collate(samples[start : start + batch_size])["tokens"].to(self.device)
            scores += sequence_scores(self.model, tokens, self.tokenizer.pad_id).float().tolist()
        return scores


def learned_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[dict[str, Any]],
    *,
    path: str,
    template: str = "auto",
    prompt_column: str | None = "prompt",
    batch_size: int = 16,
    dtype: Literal["fp32", "bf16"] = "fp32",
    sharding: Literal["auto", "replicate", "shard"] = "auto",
) -> list[float]:
    """A reward model's score of each completion (see the module docstring).

    Args:
        prompts: The rendered prompts (used when ``prompt_column`` is None or absent).
        completions: The completions.
        rows: The dataset rows; ``rows[i][prompt_column]`` is the user prompt the reward
            model sees before completion ``i``.
        path: The reward-model folder (``epoch_E`` of a reward_model_distributed run).
        template: How the reward model was trained to read a conversation: ``auto`` (its
            tokenizer's chat template) or a named format (``instruct``, ``chatml``, ...).
        prompt_column: The rows' prompt column (None: the rendered ``prompts``).
        batch_size: Sequences per forward of the reward model.
        dtype: The reward model's parameter dtype.
        sharding: ``replicate`` (every rank holds it whole), ``shard`` (FSDP2 over the ranks) or
            ``auto`` (replicate when it fits half the memory budget, logged).

    Returns:
        One score per completion.
    """
    key = (str(Path(path).resolve()), dtype, sharding, template)
    if key not in _LOADED:
        _LOADED[key] = _Scorer(Path(path), dtype, sharding, template)
    if prompt_column is not None and rows and prompt_column in rows[0]:
        prompts = [str(row[prompt_column]) for row in rows]
    return _LOADED[key](prompts, completions, batch_size)
