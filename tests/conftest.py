"""Shared fixtures: tiny random Hugging Face checkpoints built with transformers."""

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
# One intra-op thread per process, as `tunelab run` gives each worker: make test runs 2 workers
# on 2 cores, and on the tiny tensors here a second thread costs more than it saves (measured: a
# merged-rollout test took 23 CPU-s and 24 s with 2 threads, 6 CPU-s and 7 s with 1). Processes
# the tests start inherit it; OMP_NUM_THREADS set outside wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# `--cpu-profile FILE`: per-test CPU seconds, to find what makes `make test` slow.
pytest_plugins = ["tests.cpu_profile"]

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=301,  # odd, so FSDP's row split is uneven
    rms_norm_eps=1e-5,
    # Larger than HF's 0.02 so attention is sharp enough for a rotary error to show in logits.
    initializer_range=0.1,
)
_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Family name -> (config class name, config kwargs). rope_theta 500000 with head_dim 16 puts
# the rotary frequencies in all three bands of the llama3 rule.
TINY_FAMILIES = {
    "llama3_2": (
        "LlamaConfig",
        dict(
            _COMMON,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling={**_LLAMA3_SCALING, "factor": 32.0},
        ),
    ),
    "llama3_1": (
        "LlamaConfig",
        dict(
            _COMMON,
            num_hidden_layers=3,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling={**_LLAMA3_SCALING, "factor": 8.0},
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(_COMMON, tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=4096),
    ),
}
# The newer families, every feature on at tiny size: GQA, a head_dim unlike hidden / heads, a
# sliding window (5) shorter than the test sequences, one global and one sliding layer,
# soft-capping small enough to bite, q/k norms, partial rotary and LongRoPE (original length
# 12, so a 17-token sequence takes the long factors and a 10-token one the short).
_WINDOW = dict(sliding_window=5)
_GEMMA = dict(
    _COMMON,
    **_WINDOW,
    head_dim=24,
    query_pre_attn_scalar=20,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=5.0,
    layer_types=["sliding_attention", "full_attention"],
)
NEW_FAMILIES = {
    "qwen3": (
        "Qwen3Config",
        dict(
            _COMMON,
            **_WINDOW,
            head_dim=24,
            use_sliding_window=True,
            max_window_layers=1,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
        ),
    ),  # fmt: skip
    "mistral": ("MistralConfig", dict(_COMMON, **_WINDOW, head_dim=24, rope_theta=1000000.0)),
    "gemma2": ("Gemma2Config", _GEMMA),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            _GEMMA,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
    ),  # fmt: skip
    "phi3": (
        "Phi3Config",
        dict(
            _COMMON,
            **_WINDOW,
            partial_rotary_factor=0.75,
            max_position_embeddings=48,
            original_max_position_embeddings=12,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
            },
        ),
    ),  # fmt: skip
}
TINY_FAMILIES.update(NEW_FAMILIES)


def build_tiny_hf_model(family: str, **overrides):
    """The seeded random fp32 ``transformers`` model of ``TINY_FAMILIES[family]``.

    ``overrides`` replace config keys (e.g. ``vocab_size`` to fit another tokenizer).
    """
    import transformers

    config_class, kwargs = TINY_FAMILIES[family]
    config = getattr(transformers, config_class)(**{**kwargs, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Give the norms non-trivial scales so a dropped norm weight would show in logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


@pytest.fixture(scope="session")
def tiny_hf_model_dir(tmp_path_factory):
    """Factory ``make(family, sharded=False) -> Path`` of a tiny random HF checkpoint (fp32).

    ``family`` is one of ``TINY_FAMILIES``; ``sharded=True`` saves with a small
    ``max_shard_size`` so the weights span several files plus an index. Each checkpoint is
    built once per session (seeded) and must be treated as read-only.
    """
    pytest.importorskip("transformers")
    built: dict[tuple[str, bool], Path] = {}

    def make(family: str, sharded: bool = False) -> Path:
        if (family, sharded) not in built:
            model = build_tiny_hf_model(family)
            path = tmp_path_factory.mktemp(f"hf_{family}_{'sharded' if sharded else 'single'}")
            model.save_pretrained(path, max_shard_size=40_000 if sharded else "5GB")
            built[(family, sharded)] = path
        return built[(family, sharded)]

    return make


@pytest.fixture
def world_of_one():
    """A one-process gloo group for the test, as its one-rank CPU ``DeviceMesh``."""
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
