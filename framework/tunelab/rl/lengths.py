"""GRPO's length bounds, checked at set-up before the first rollout allocates anything.

A prompt and its completion must fit the model's context (``max_position_embeddings``): a
prompt longer than ``max_position_embeddings - max_new_tokens`` (the default
``max_prompt_tokens``, derived from the model) keeps its last tokens, as
``prompt_dataset(max_prompt_tokens=...)`` cuts them, and the run says how many were cut. Then
the rollout engine checks the longest prompt against the context and the KV cache of a
micro-batch's ``batch_size x num_generations`` sequences against the device's free memory
(:meth:`~tunelab.rl.ModelRolloutEngine.check_lengths`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tunelab.errors import DataError
from tunelab.rl.rollout import ModelRolloutEngine

__all__ = ["bound_prompt_lengths", "cut_prompts"]

logger = logging.getLogger(__name__)


def cut_prompts(prompts: Any, max_tokens: int, tokenizer: Any) -> int:
    """Cut every prompt longer than ``max_tokens`` to its last ``max_tokens`` tokens, in place.

    The rendered text the rewards see is decoded again from the tokens kept, and the dataset's
    ``num_truncated`` counts the prompts cut (as ``prompt_dataset``'s own cut does).

    Args:
        prompts: A prompt dataset (``tokens`` and ``prompts`` by index, ``num_truncated``).
        max_tokens: Tokens a prompt may have.
        tokenizer: Decodes the kept tokens (``decode(ids, skip_special_tokens=False)``).

    Returns:
        The number of prompts cut.

    Raises:
        DataError: A prompt with images would be cut.
    """
    cut = 0
    images = getattr(prompts, "images", None)
    for index, ids in enumerate(prompts.tokens):
        if len(ids) > max_tokens and images is not None and images[index]:
            raise DataError(
                f"prompt {index} is {len(ids)} tokens with its images, more than the "
                f"{max_tokens} left for a prompt (max_position_embeddings - max_new_tokens): "
                "cutting it would cut its images; lower rollout.max_new_tokens or drop the row"
            )
        if len(ids) > max_tokens:
            prompts.tokens[index] = ids[-max_tokens:]
            prompts.prompts[index] = tokenizer.decode(
                prompts.tokens[index], skip_special_tokens=False
            )
            cut += 1
    prompts.num_truncated = getattr(prompts, "num_truncated", 0) + cut
    return cut


def bound_prompt_lengths(
    engine: ModelRolloutEngine,
    datasets: Mapping[str, Any],
    tokenizer: Any,
    *,
    rows: int,
) -> None:
    """Fit every prompt to the model's context, then check the largest rollout's memory.

    Args:
        engine: The rollout engine (its model's ``max_seq_len`` and ``max_new_tokens``).
        datasets: Prompt datasets by their config key (``dataset``, ``val_dataset``).
        tokenizer: Decodes cut prompts.
        rows: Sequences one ``generate`` call samples (``batch_size x num_generations``).

    Raises:
        ConfigError: ``max_new_tokens`` leaves no room for a prompt in the context, or the KV
            cache of ``rows`` sequences of the longest prompt plus ``max_new_tokens`` does not
            fit the memory free on the device (the message gives the size and the settings).
    """
    context = engine.model.args.max_seq_len
    new_tokens = engine.settings.max_new_tokens
    engine.check_lengths(rows, 1)  # no room for even one prompt token: refused up front
    limit = context - new_tokens
    for key, prompts in datasets.items():
        cut = cut_prompts(prompts, limit, tokenizer)
        if cut:
            logger.info(
                "%s: %d of %d prompts are longer than %d tokens (max_position_embeddings %d - "
                "max_new_tokens %d) and keep their last %d tokens; set %s.max_prompt_tokens "
                "to cut them shorter",
                key, cut, len(prompts), limit, context, new_tokens, limit, key,
            )  # fmt: skip
    longest = max((len(ids) for prompts in datasets.values() for ids in prompts.tokens), default=1)
    engine.check_lengths(rows, longest)
