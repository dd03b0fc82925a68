"""The rollout engine's decode loop: prompts prefilled once per group, finished rows leaving
the batch, the folded GQA kernel, and the compiled decode step (tokens equal eager's)."""

import logging

import pytest
import torch
import torch.nn.functional as F

from tunelab.models.args import ModelArgs
from tunelab.models.decoder import TransformerDecoder
from tunelab.modules import KVCache
from tunelab.modules.attention import folded_gqa_attention
from tunelab.rl import ModelRolloutEngine, SamplingSettings, sampling_seeds
from tunelab.rl.decoding import DecodeStep, distinct_prompts

VOCAB = 61
STOPS = frozenset(range(6, 20))  # the random models' completions end at many lengths


def small_model(num_layers: int = 2) -> TransformerDecoder:
    """A random GQA decoder (its completions end at different lengths with ``STOPS``)."""
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=VOCAB, dim=32, num_layers=num_layers, num_heads=4, num_kv_heads=2,
        intermediate_dim=48, head_dim=8, max_seq_len=64,
    )  # fmt: skip
    model = TransformerDecoder(args)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.5)
    return model.eval()


def group_prompts(num_prompts: int, num_generations: int) -> tuple[list[list[int]], list[int]]:
    generator = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(6, VOCAB, (2 + index % 5,), generator=generator).tolist()
        for index in range(num_prompts)
    ]
    rows = [prompt for prompt in prompts for _ in range(num_generations)]
    return rows, sampling_seeds(0, 0, list(range(num_prompts)), num_generations)


def test_distinct_prompts_finds_equal_prompts_anywhere():
    unique, of_row = distinct_prompts([[1, 2], [3], [1, 2], [1], [3]])
    assert unique == [[1, 2], [3], [1]]
    assert of_row == [0, 1, 0, 2, 1]


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
def test_a_group_prefilled_once_samples_what_each_row_samples_alone(temperature, monkeypatch):
    model = small_model()
    settings = SamplingSettings(max_new_tokens=9, temperature=temperature, stop_ids=STOPS)
    engine = ModelRolloutEngine(model, settings, pad_id=0)
    rows, seeds = group_prompts(3, 4)
    batch_sizes = []  # each layer's cache rows after each select_rows (expand, then compact)
    select_rows = KVCache.select_rows

    def recorded(cache, index):
        select_rows(cache, index)
        batch_sizes.append(cache.k_cache.shape[0])

    monkeypatch.setattr(KVCache, "select_rows", recorded)
    together = engine.generate(rows, seeds)
    assert batch_sizes[:2] == [12, 12] and min(batch_sizes) < 6  # expanded, then compacted
    monkeypatch.undo()
    assert engine.last_generated_tokens == sum(len(c) for c in together)
    alone = [engine.generate([row], [seed])[0] for row, seed in zip(rows, seeds, strict=True)]
    assert together == alone
    lengths = {len(completion) for completion in together}
    assert len(lengths) > 2  # rows finished at several steps


def test_folded_gqa_attention_equals_repeated_key_values():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 6, 2, 8), torch.randn(3, 2, 10, 8), torch.randn(3, 2, 10, 8)
    mask = (torch.arange(10)[None, None, :] <= torch.tensor([[3], [9], [5]])[:, :, None])[:, None]
    mask = mask.expand(3, 1, 2, 10)
    repeated = F.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), attn_mask=mask
    )
    torch.testing.assert_close(folded_gqa_attention(q, k, v, mask), repeated, rtol=0, atol=1e-6)


def test_a_failed_compile_decodes_eagerly_with_one_line(monkeypatch, caplog):
    model = small_model()
    settings = SamplingSettings(max_new_tokens=6, stop_ids={5})
    rows, seeds = group_prompts(2, 2)
    eager = ModelRolloutEngine(model, settings, pad_id=0).generate(rows, seeds)

    def broken(*args, **kwargs):
        raise RuntimeError("inductor: no C++ compiler\nmore detail")

    monkeypatch.setattr(DecodeStep, "_compiled", {"cpu": broken})
    engine = ModelRolloutEngine(model, settings, pad_id=0, compile=True)
    with caplog.at_level(logging.WARNING, logger="tunelab.rl.decoding"):
        assert engine.generate(rows, seeds) == eager
    lines = [r.getMessage() for r in caplog.records if "rollout.compile" in r.getMessage()]
    assert lines == [
        "rollout.compile: compiling the decode step failed (RuntimeError: inductor: no C++ "
        "compiler); decoding eagerly"
    ]


@pytest.mark.slow
def test_the_compiled_decode_step_samples_the_eager_tokens():
    # 16 prompts x 4 = 64 completions each way; rows finish early, so the compiled step also
    # runs the smaller batch buckets.
    model = small_model(num_layers=1)
    rows, seeds = group_prompts(16, 4)
    for temperature in (1.0, 0.0):
        settings = SamplingSettings(max_new_tokens=8, temperature=temperature, stop_ids=STOPS)
        eager = ModelRolloutEngine(model, settings, pad_id=0).generate(rows, seeds)
        engine = ModelRolloutEngine(model, settings, pad_id=0, compile=True)
        compiled = engine.generate(rows, seeds)
        step = DecodeStep(model, compile=True)
        assert step.compiled and DecodeStep._compiled  # it compiled: no fallback
        assert compiled == eager
        assert len({len(completion) for completion in eager}) > 2
