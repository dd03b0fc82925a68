"""The rollout engine's decode loop: prompts prefilled once per group, finished rows leaving
the batch, the folded GQA kernel, the explicit decode attention (= SDPA), and the compiled
decode step (tokens equal eager's)."""

import logging

import pytest
import torch
import torch.nn.functional as F

from tunelab.models.args import ModelArgs
from tunelab.models.decoder import TransformerDecoder
from tunelab.modules import KVCache, attention
from tunelab.modules.attention import Attention, decode_attention, folded_gqa_attention
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


def _ragged_cache(groups: int, kv_heads: int = 2, keys: int = 13):
    """One decode query per row against a cache whose rows are filled to different slots.

    Rows sit at positions 0 (only their first slot), 3, 12 (the whole cache), 7 and 5; the
    slots past a row's position hold large keys and values (a prefill's padding, stale
    tokens), so attending to one of them moves the output far past rounding.
    """
    torch.manual_seed(0)
    batch, head_dim = 5, 16
    q = torch.randn(batch, kv_heads * groups, 1, head_dim)
    k = torch.randn(batch, kv_heads, keys, head_dim)
    v = torch.randn(batch, kv_heads, keys, head_dim)
    positions = torch.tensor([0, 3, 12, 7, 5])
    mask = (torch.arange(keys)[None, :] <= positions[:, None])[:, None, None]
    k = torch.where(mask.transpose(2, 3), k, 30 * torch.randn_like(k))
    v = torch.where(mask.transpose(2, 3), v, 100 * torch.randn_like(v))
    return q, k, v, mask


@pytest.mark.parametrize("groups", [1, 3, 4])
def test_decode_attention_equals_sdpa_on_ragged_gqa_caches(groups):
    q, k, v, mask = _ragged_cache(groups)
    reference = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), attn_mask=mask
    )
    exact = F.scaled_dot_product_attention(  # the same in fp64: both within fp32 rounding of it
        q.double(),
        k.double().repeat_interleave(groups, dim=1),
        v.double().repeat_interleave(groups, dim=1),
        attn_mask=mask,
    )

    def matches(out: torch.Tensor) -> bool:
        return torch.allclose(out, reference, rtol=0, atol=2e-6)

    out = decode_attention(q, k, v, mask)
    assert out.shape == q.shape
    assert matches(out)
    assert (out.double() - exact).abs().max() <= 2 * (reference.double() - exact).abs().max() + 1e-6
    # A scale and a mask shared by every row (batch 1) broadcast as SDPA's do.
    k_plain, v_plain, shared = torch.randn_like(k), torch.randn_like(v), mask[1:2]
    assert torch.allclose(
        decode_attention(q, k_plain, v_plain, shared, scale=0.3),
        F.scaled_dot_product_attention(
            q,
            k_plain.repeat_interleave(groups, dim=1),
            v_plain.repeat_interleave(groups, dim=1),
            attn_mask=shared,
            scale=0.3,
        ),
        rtol=0,
        atol=2e-6,
    )
    # The check catches a mask off by one slot, or no mask at all ...
    assert not matches(decode_attention(q, k, v, torch.roll(mask, 1, dims=-1) | mask))
    assert not matches(decode_attention(q, k, v, torch.ones_like(mask)))
    if groups > 1:
        # ... and query heads grouped the other way (head h on K/V head h % kv_heads).
        heads, kv_heads = q.shape[1], k.shape[1]
        order = sorted(range(heads), key=lambda head: head % kv_heads)
        tiled = decode_attention(q[:, order], k, v, mask)[:, torch.tensor(order).argsort()]
        assert not matches(tiled)


def test_a_rows_decode_attention_does_not_depend_on_its_neighbours():
    # The shared prefill and the compaction of finished rows rely on it: each row alone, bit
    # for bit the row in the batch (the bench's heads, 12/4 x 64, over 64 slots).
    q, k, v, mask = _ragged_cache(groups=3, keys=64)
    q = torch.randn(q.shape[0], 12, 1, 64)
    k, v = torch.randn(q.shape[0], 4, 64, 64), torch.randn(q.shape[0], 4, 64, 64)
    together = decode_attention(q, k, v, mask)
    for row in range(q.shape[0]):
        alone = decode_attention(
            q[row : row + 1], k[row : row + 1], v[row : row + 1], mask[row : row + 1]
        )
        assert torch.equal(alone[0], together[row])


def test_cached_decode_steps_run_decode_attention_and_equal_sdpa(monkeypatch):
    # The model's decode forward (ragged positions, GQA 4/2) with the explicit path and with
    # SDPA: the same logits within fp32 rounding; the prefill (several queries) keeps SDPA.
    # The cache's slots past the last position hold NaN, which any read spreads (0 x NaN):
    # a forward reads only the slots up to the batch's largest position.
    model = small_model()
    tokens = torch.randint(6, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([6, 2, 4])

    def decode_logits() -> list[torch.Tensor]:
        model.setup_caches(3, 16)
        try:
            width = torch.arange(6).expand(3, 6)
            model(tokens, input_pos=width)
            for layer in model.layers:
                layer.self_attn.kv_cache.k_cache[:, :, 11:] = float("nan")
                layer.self_attn.kv_cache.v_cache[:, :, 11:] = float("nan")
            logits = []
            for step in range(5):
                step_tokens = tokens[:, step : step + 1]
                positions = (lengths + step)[:, None]
                logits.append(model(step_tokens, input_pos=positions)[:, -1])
            return logits
        finally:
            model.teardown_caches()

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return decode_attention(*args, **kwargs)

    with torch.no_grad():
        monkeypatch.setattr(attention, "decode_attention", counted)
        explicit = decode_logits()
        assert len(calls) == 5 * 2 and all(shape[2] == 1 for shape in calls)  # decode only
        monkeypatch.setattr(Attention, "_decodes_explicitly", lambda *args: False)
        sdpa = decode_logits()
        # Each row's whole sequence (prompt, then the tokens fed at each step) without a cache.
        full = []
        for row, length in enumerate(lengths.tolist()):
            sequence = torch.cat([tokens[row, :length], tokens[row, :5]])[None]
            full.append(model(sequence)[0, length:])
    assert len(calls) == 10
    for step, (ours, theirs) in enumerate(zip(explicit, sdpa, strict=True)):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        uncached = torch.stack([row_logits[step] for row_logits in full])
        torch.testing.assert_close(ours, uncached, rtol=0, atol=1e-4)


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
