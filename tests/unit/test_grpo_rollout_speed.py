"""The rollout phase's fast paths: adapters merged for the call, batched sampling.

Merging changes rounding only (the update is added to the weight, not the output): logits move
by a few 1e-6 on the tiny model, and the sampled tokens are the unmerged path's on every prompt
tried here. Batched sampling draws the very tokens ``torch.multinomial`` draws, row by row.
"""

from pathlib import Path

import pytest
import torch

import tunelab.peft.inference_merge as inference_merge
from tests.interop.adapter_checks import randomize_lora_b
from tunelab.config.lora import LoRAArgs
from tunelab.data import load_tokenizer, prompt_dataset
from tunelab.modules import packed_linear
from tunelab.peft import LoRALinear, disable_adapter, merged_adapters
from tunelab.peft.nf4 import is_nf4
from tunelab.rl import ModelRolloutEngine, SamplingSettings, sample_tokens, sampling_seeds
from tunelab.training import load_model

TINY = Path(__file__).resolve().parents[2] / "framework" / "tunelab" / "assets" / "tiny"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Merged against adapted logits of the tiny model (|logits| up to 13) with lora_B ~ N(0, 0.2):
# measured at most 8.3e-6 for LoRA, DoRA and NF4 alike.
LOGIT_TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def tokenizer_and_prompts():
    tokenizer = load_tokenizer(str(TINY), max_seq_len=256)
    data = prompt_dataset(
        tokenizer, source="json", data_files=str(TINY / "grpo_prompts.jsonl"), template="instruct"
    )
    return tokenizer, data


def adapted_model(**lora_options) -> torch.nn.Module:
    """The tiny model with LoRA on every projection, lora_B random (a fresh B would be zero)."""
    torch.manual_seed(0)
    lora = LoRAArgs(rank=8, alpha=16.0, targets=TARGETS, **lora_options)
    model = load_model(str(TINY), device=torch.device("cpu"), dtype=torch.float32, lora=lora)
    randomize_lora_b(model)
    return model


def lora_layers(model: torch.nn.Module) -> list[LoRALinear]:
    return [module for module in model.modules() if isinstance(module, LoRALinear)]


def snapshot(model: torch.nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """Each parameter's storage address and a copy of its values (dequantized if NF4)."""
    return {
        name: (
            param.data_ptr(),
            (param.get_original_weight() if is_nf4(param) else param.detach()).clone(),
        )
        for name, param in model.named_parameters()
    }


def assert_untouched(model: torch.nn.Module, before: dict[str, tuple[int, torch.Tensor]]) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, (address, values) in before.items():
        assert after[name][0] == address, name  # the same storage: nothing swapped
        assert torch.equal(after[name][1], values), name  # bit for bit
    assert all(layer.merged_weight is None for layer in lora_layers(model))


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_merged_forward_equals_the_adapted_one_and_leaves_the_weights_alone(
    tokenizer_and_prompts, variant
):
    _, data = tokenizer_and_prompts
    model = adapted_model(use_dora=variant == "dora").eval()
    tokens = torch.tensor([data.tokens[0], data.tokens[0][::-1]])
    before = snapshot(model)
    with torch.no_grad():
        adapted = model(tokens)
        with merged_adapters(model) as merged:
            assert merged == len(lora_layers(model)) == 3 * len(TARGETS)
            merged_logits = model(tokens)
            layer = lora_layers(model)[0]
            assert layer.merged_weight.data_ptr() != layer.weight.data_ptr()
        unmerged_again = model(tokens)
    torch.testing.assert_close(merged_logits, adapted, atol=LOGIT_TOLERANCE, rtol=0)
    assert torch.equal(unmerged_again, adapted)  # the block left nothing behind
    assert_untouched(model, before)


def test_nf4_disabled_and_dropout_layers_stay_unmerged(tokenizer_and_prompts):
    _, data = tokenizer_and_prompts
    tokens = torch.tensor([data.tokens[1]])
    quantized = adapted_model(quantize_base="nf4").eval()
    nf4_layers = [layer for layer in lora_layers(quantized) if is_nf4(layer.weight)]
    assert 0 < len(nf4_layers) < len(lora_layers(quantized))  # the tiny model keeps some in fp32
    before = snapshot(quantized)
    with torch.no_grad():
        adapted = quantized(tokens)
        with merged_adapters(quantized) as merged:
            # NF4 layers compute as without the block; the others merge.
            assert merged == len(lora_layers(quantized)) - len(nf4_layers)
            assert all(layer.merged_weight is None for layer in nf4_layers)
            torch.testing.assert_close(quantized(tokens), adapted, atol=LOGIT_TOLERANCE, rtol=0)
    assert_untouched(quantized, before)

    model = adapted_model().eval()
    with torch.no_grad(), disable_adapter(model):
        base = model(tokens)
        with merged_adapters(model) as merged:
            assert merged == 0
            assert torch.equal(model(tokens), base)

    dropout = adapted_model(dropout=0.1)
    with merged_adapters(dropout.train()) as merged:
        assert merged == 0  # the merged form has no dropout
    with merged_adapters(dropout.eval()) as merged:
        assert merged == len(lora_layers(dropout))


def test_merged_adapters_are_dropped_when_the_block_raises():
    model = adapted_model().eval()
    with pytest.raises(RuntimeError, match="inside"), merged_adapters(model):
        raise RuntimeError("inside")
    assert all(layer.merged_weight is None for layer in lora_layers(model))


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_merged_rollouts_sample_the_unmerged_tokens_and_leave_the_weights_alone(
    tokenizer_and_prompts, variant, monkeypatch
):
    tokenizer, data = tokenizer_and_prompts
    model = adapted_model(use_dora=variant == "dora")
    indices = list(range(8))
    prompts = [data.tokens[i] for i in indices for _ in range(4)]
    seeds = sampling_seeds(0, 0, indices, 4)
    merges = []
    merge_weight = inference_merge.merge_weight
    monkeypatch.setattr(
        inference_merge, "merge_weight", lambda *a: merges.append(1) or merge_weight(*a)
    )
    before = snapshot(model)
    for temperature in (1.0, 0.0):
        settings = SamplingSettings(
            max_new_tokens=24, temperature=temperature, stop_ids=frozenset(tokenizer.stop_ids)
        )
        merged = ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id)
        unmerged = ModelRolloutEngine(
            model, settings, pad_id=tokenizer.pad_id, merge_adapters=False
        )
        merges.clear()
        completions = merged.generate(prompts, seeds)
        # Each adapter merged once for the call, not once per token.
        assert len(merges) == len(lora_layers(model))
        assert max(len(c) for c in completions) > 1
        assert completions == unmerged.generate(prompts, seeds)
        assert merged.last_entropy_sum == pytest.approx(unmerged.last_entropy_sum, rel=1e-5)
    assert model.training  # the mode comes back
    assert_untouched(model, before)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")
def test_rollouts_on_packed_weights_sample_the_unpacked_tokens(tokenizer_and_prompts, monkeypatch):
    tokenizer, data = tokenizer_and_prompts
    model = adapted_model()
    indices = list(range(16))
    prompts = [data.tokens[i] for i in indices for _ in range(4)]
    seeds = sampling_seeds(0, 0, indices, 4)
    packs = []
    pack_weight = packed_linear.pack_weight
    monkeypatch.setattr(packed_linear, "pack_weight", lambda *a: packs.append(1) or pack_weight(*a))
    before = snapshot(model)
    for temperature in (1.0, 0.0):
        settings = SamplingSettings(
            max_new_tokens=24, temperature=temperature, stop_ids=frozenset(tokenizer.stop_ids)
        )
        packs.clear()
        packed = ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id).generate(
            prompts, seeds
        )
        # once for the call: each layer's q/k/v as one matrix, o, gate/up as one, down;
        # and the output layer (every projection adapted: 7 adapters a layer)
        layers = len(lora_layers(model)) // 7
        assert len(packs) == 4 * layers + 1
        plain = ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id, pack_weights=False)
        assert packed == plain.generate(prompts, seeds)  # 64 completions
        assert len({len(c) for c in packed}) > 1
    assert_untouched(model, before)
    assert "forward" not in model.lm_head.__dict__


@pytest.mark.parametrize("vocab", [810, 4099])
@pytest.mark.parametrize(
    "settings",
    [
        SamplingSettings(1),
        SamplingSettings(1, temperature=0.7, top_k=50),
        SamplingSettings(1, temperature=1.3, top_p=0.9),
    ],
    ids=["plain", "top_k", "top_p"],
)
def test_sample_tokens_races_each_rows_own_uniforms(vocab, settings):
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    # The distribution each row samples from, computed as sample_tokens does.
    reference = logits / settings.temperature
    if settings.top_k is not None:
        kth = torch.topk(reference, settings.top_k, dim=-1).values[:, -1:]
        reference = reference.masked_fill(reference < kth, float("-inf"))
    probs = torch.softmax(reference, dim=-1)
    if settings.top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered >= settings.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered)
    for draw in range(5):
        ours = [torch.Generator().manual_seed(100 * draw + row) for row in range(12)]
        theirs = [torch.Generator().manual_seed(100 * draw + row) for row in range(12)]
        tokens = sample_tokens(logits, settings, ours)
        expected = []
        for row, generator in enumerate(theirs):
            # One row alone: a uniform per token from the row's generator, the exponential
            # race over them.
            uniform = torch.rand(vocab, generator=generator)
            expected.append(int(torch.argmax(probs[row] / -torch.log(uniform))))
        assert tokens.tolist() == expected
        assert all(probs[row, token] > 0 for row, token in enumerate(tokens.tolist()))
        # The same draws: each generator stands where the reference's left it.
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(ours, theirs))


def test_sample_tokens_frequencies_follow_the_probabilities():
    # 40000 draws (4000 rows, each its own generator, 10 rounds) from one distribution with a
    # token top-k filters out: Pearson's chi-square against the probabilities stays under the
    # 1e-6 quantile of chi-square with 5 degrees of freedom (35.9); the filtered token, never.
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0005])
    logits = probs.log().expand(4000, -1)
    settings = SamplingSettings(1, top_k=6)
    generators = [torch.Generator().manual_seed(7919 * row) for row in range(4000)]
    counts = torch.zeros(7, dtype=torch.long)
    for _ in range(10):
        counts += torch.bincount(sample_tokens(logits, settings, generators), minlength=7)
    assert counts[6] == 0
    kept = probs[:6] / probs[:6].sum()
    expected = kept.double() * counts.sum()
    chi_square = float(((counts[:6].double() - expected) ** 2 / expected).sum())
    assert chi_square < 35.9, (counts.tolist(), chi_square)


def test_rows_left_out_of_sampling_keep_their_generator():
    logits = torch.randn(4, 810, generator=torch.Generator().manual_seed(0))
    generators = [torch.Generator().manual_seed(row) for row in range(4)]
    fresh = [g.get_state() for g in generators]
    active = [True, False, True, False]
    tokens = sample_tokens(logits, SamplingSettings(1), generators, active)
    assert tokens[1] == logits[1].argmax() and tokens[3] == logits[3].argmax()
    moved = [not torch.equal(g.get_state(), state) for g, state in zip(generators, fresh)]
    assert moved == active
    every = [torch.Generator().manual_seed(row) for row in range(4)]
    assert tokens[::2].tolist() == sample_tokens(logits, SamplingSettings(1), every)[::2].tolist()


def test_non_finite_sampling_probabilities_are_one_clear_error():
    logits = torch.zeros(2, 810)
    logits[1, 3] = float("nan")
    generators = [torch.Generator().manual_seed(row) for row in range(2)]
    with pytest.raises(ValueError, match="not finite"):
        sample_tokens(logits, SamplingSettings(1), generators)
