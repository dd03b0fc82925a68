"""Autoregressive decoding with a KV cache: greedy, or temperature / top-k sampling."""

import torch
from torch import nn

__all__ = ["generate"]


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick the next token from the last position's logits.

    Args:
        logits: ``[batch, vocab]`` logits of the last position.
        temperature: 0 for greedy (argmax); otherwise logits are divided by it.
        top_k: Keep only the k most likely tokens before sampling.
        generator: RNG for sampling.

    Returns:
        ``[batch]`` token ids.
    """
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    *,
    max_new_tokens: int,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Generate a completion of ``prompt`` with the model's KV cache.

    The prompt is prefilled in one forward; each new token then costs one single-position
    forward that reads the cached keys and values.

    Args:
        model: A ``TransformerDecoder`` (``setup_caches`` / ``reset_caches``).
        prompt: Prompt token ids.
        max_new_tokens: Upper bound on generated tokens.
        stop_ids: Tokens that end generation (included in the output).
        temperature: 0 for greedy decoding.
        top_k: Top-k sampling filter.
        generator: RNG for sampling.

    Returns:
        The generated token ids (without the prompt).
    """
    device = next(model.parameters()).device
    model.setup_caches(1, len(prompt) + max_new_tokens, device=device)
    # LongRoPE rotates with other factors once a sequence passes the original length, which
    # changes every cached key: re-encode the whole sequence there, as transformers does.
    recompute_at = getattr(model, "rope_recompute_position", lambda: None)()

    def encode(token_ids: list[int], start: int) -> torch.Tensor:
        tokens = torch.tensor([token_ids], device=device)
        positions = torch.arange(start, start + len(token_ids), device=device)[None]
        # Logits of the last position only: a long prompt never makes [prompt, vocab] logits.
        hidden = model(tokens, input_pos=positions, return_hidden=True)
        return model.output(hidden[:, -1])

    try:
        logits = encode(prompt, 0)
        generated: list[int] = []
        for step in range(max_new_tokens):
            next_token = sample_next(
                logits, temperature=temperature, top_k=top_k, generator=generator
            )
            generated.append(int(next_token))
            if generated[-1] in stop_ids or step == max_new_tokens - 1:
                break
            position = len(prompt) + step
            if position == recompute_at:
                model.reset_caches()
                logits = encode(prompt + generated, 0)
            else:
                logits = encode(generated[-1:], position)
        return generated
    finally:
        model.teardown_caches()
