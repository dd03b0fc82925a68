"""GRPO lengths are bounded before anything is allocated (issue 38, finding 4).

Before: ``max_new_tokens=1000000000`` reached ``setup_caches`` and asked for terabytes, and a
prompt longer than ``max_position_embeddings`` was sampled and trained on silently.
"""

import logging
from pathlib import Path

import pytest
import torch

import tunelab.rl.rollout as rollout_module
from tunelab import ConfigError
from tunelab.data import load_tokenizer, prompt_dataset
from tunelab.rl import ModelRolloutEngine, SamplingSettings, bound_prompt_lengths
from tunelab.training import load_model

TINY = Path(__file__).resolve().parents[2] / "framework" / "tunelab" / "assets" / "tiny"
CONTEXT = 512  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def tiny():
    tokenizer = load_tokenizer(str(TINY))
    model = load_model(str(TINY), device=torch.device("cpu"), mesh=None, dtype=torch.float32)
    assert model.args.max_seq_len == CONTEXT
    return tokenizer, model


def _engine(model, tokenizer, max_new_tokens: int) -> ModelRolloutEngine:
    settings = SamplingSettings(max_new_tokens=max_new_tokens, temperature=1.0)
    return ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id, decode=tokenizer.decode)


def test_max_new_tokens_past_the_context_is_refused_before_allocating(tiny):
    tokenizer, model = tiny
    engine = _engine(model, tokenizer, 1_000_000_000)
    with pytest.raises(
        ConfigError,
        match=r"a prompt of 3 tokens \+ max_new_tokens 1000000000 = 1000000003 exceed the "
        r"model's context \(max_position_embeddings 512\)",
    ):
        engine.generate([[5, 6, 7]], [0])


def test_a_prompt_past_the_context_is_refused_by_the_engine(tiny):
    tokenizer, model = tiny
    engine = _engine(model, tokenizer, 12)
    with pytest.raises(ConfigError, match=r"a prompt of 501 tokens \+ max_new_tokens 12 = 513"):
        engine.generate([[5] * 501], [0])
    assert len(engine.generate([[5] * 500], [0])[0]) <= 12  # 500 + 12 = 512 fits


def test_the_kv_cache_estimate_is_what_generate_allocates_and_is_checked(tiny, monkeypatch):
    tokenizer, model = tiny
    engine = _engine(model, tokenizer, 12)
    model.setup_caches(16, 40 + 12)
    allocated = sum(
        buffer.numel() * buffer.element_size()
        for name, buffer in model.named_buffers()
        if "cache" in name
    )
    model.teardown_caches()
    assert engine.kv_cache_bytes(16, 52) == allocated > 0
    # The device's free memory is what the check compares with; make it one byte short.
    monkeypatch.setattr(rollout_module, "memory_budget_bytes", lambda device: allocated - 1)
    with pytest.raises(ConfigError) as info:
        engine.check_lengths(16, 40)
    message = str(info.value)
    assert f"needs {allocated / 2**30:.1f} GiB for the KV cache (16 sequences" in message
    args = model.args
    assert (
        f"(40 prompt + 12 new tokens) x {args.num_layers} layers x 2 x {args.num_kv_heads} KV "
        f"heads x {args.head_dim} x 4 bytes), more than the 0.0 GiB free" in message
    )
    assert "lower rollout.max_new_tokens, schedule.batch_size or rollout.num_generations" in message
    monkeypatch.setattr(rollout_module, "memory_budget_bytes", lambda device: allocated)
    engine.check_lengths(16, 40)


def test_prompts_past_the_context_keep_their_last_tokens_and_are_counted(tiny, tmp_path, caplog):
    tokenizer, model = tiny
    path = tmp_path / "prompts.jsonl"
    long_prompt = " ".join(f"word{i}" for i in range(3000))
    path.write_text(
        f'{{"prompt": "short one", "answer": "1"}}\n{{"prompt": "{long_prompt}", "answer": "2"}}\n'
    )
    dataset = prompt_dataset(tokenizer, source=str(path), template=None)
    full = list(dataset.tokens[1])
    assert len(full) > CONTEXT and len(dataset.tokens[0]) < 20
    engine = _engine(model, tokenizer, 12)
    logging.getLogger("tunelab").propagate = True  # the recipes' handler may have stopped it
    with caplog.at_level(logging.INFO, logger="tunelab"):
        bound_prompt_lengths(engine, {"dataset": dataset}, tokenizer, rows=8)
    assert dataset.tokens[1] == full[-500:] and len(dataset.tokens[0]) < 20
    assert dataset.prompts[1] == tokenizer.decode(full[-500:], skip_special_tokens=False)
    assert dataset.num_truncated == 1
    assert (
        "dataset: 1 of 2 prompts are longer than 500 tokens (max_position_embeddings 512 - "
        "max_new_tokens 12) and keep their last 500 tokens" in caplog.text
    )
    completions = engine.generate([dataset.tokens[1]] * 2, [0, 1])  # fits the context now
    assert all(len(completion) <= 12 for completion in completions)


def test_no_room_for_a_prompt_is_refused_up_front(tiny):
    tokenizer, model = tiny
    engine = _engine(model, tokenizer, CONTEXT)
    with pytest.raises(ConfigError, match="a prompt of 1 tokens"):
        bound_prompt_lengths(engine, {}, tokenizer, rows=8)
