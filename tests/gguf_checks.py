"""llama.cpp (through llama-cpp-python) against tunelab's own model, for the GGUF export tests."""

from pathlib import Path

import numpy as np
import pytest
import torch

PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Question: what is 2 + 3?\nAnswer:",
    "<|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|>",
)
NUM_GENERATED = 20


def llama(path: Path, **options):
    """The GGUF file loaded by llama.cpp, every position's logits kept, one thread.

    ``options`` go to ``llama_cpp.Llama`` (e.g. ``type_k=0, type_v=0`` for a float32 KV cache).
    """
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=128,
        logits_all=True,
        verbose=False,
        n_threads=1,
        seed=0,
        **options,
    )


def llama_logits(model, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits ``[len(ids), vocab]`` for ``ids``, from an empty context."""
    model.reset()
    model.eval(ids)
    return np.array(model.scores[: len(ids)], dtype=np.float64)


def llama_greedy(model, ids: list[int], count: int = NUM_GENERATED) -> list[int]:
    """``count`` greedily generated ids, one ``eval`` per token."""
    model.reset()
    model.eval(ids)
    out = []
    for _ in range(count):
        token = int(np.argmax(model.scores[model.n_tokens - 1]))
        out.append(token)
        model.eval([token])
    return out


def tunelab_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """tunelab's fp32 logits ``[len(ids), vocab]``."""
    with torch.no_grad():
        return model(torch.tensor([ids])).double()[0].numpy()


def tunelab_greedy(model: torch.nn.Module, ids: list[int], count: int = NUM_GENERATED) -> list[int]:
    """``count`` greedily generated ids, a full forward per token."""
    ids, out = list(ids), []
    for _ in range(count):
        token = int(tunelab_logits(model, ids)[-1].argmax())
        out.append(token)
        ids.append(token)
    return out


def prompt_ids(tokenizer, text: str) -> list[int]:
    """transformers' ids of a prompt, BOS as the tokenizer config says, special tokens parsed."""
    return tokenizer(text)["input_ids"]


def perplexity(model, sequences: list[list[int]]) -> float:
    """llama.cpp's perplexity over ``sequences`` (each scored from its second token on)."""
    total, count = 0.0, 0
    for ids in sequences:
        logits = llama_logits(model, ids)[:-1]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        total -= log_probs[np.arange(len(ids) - 1), ids[1:]].sum()
        count += len(ids) - 1
    return float(np.exp(total / count))


def with_float16_gelu(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its tanh-GELU computed as ggml's CPU kernel does: input and output rounded
    to float16 (ggml looks the value up in a 65536-entry float16 table)."""
    from tunelab.modules.feed_forward import ACTIVATIONS, FeedForward

    gelu = ACTIVATIONS["gelu_pytorch_tanh"]
    for module in model.modules():
        if isinstance(module, FeedForward) and module.activation is gelu:
            module.activation = lambda x: gelu(x.half().float()).half().float()
    return model
