"""The newer families' parts with hand-checked values: Gemma's norm, soft-caps, the sliding
window, partial rotary, LongRoPE, and both config.json layouts of each family."""

import math

import pytest
import torch

from tunelab.config.lora import LoRAArgs
from tunelab.errors import ConfigError
from tunelab.models import ModelArgs, TransformerDecoder, args_from_hf
from tunelab.modules import Attention, RMSNorm
from tunelab.modules.rotary import RotaryEmbedding, apply_rotary, inverse_frequencies

_SHAPE = dict(vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2)
_HF_SHAPE = dict(
    vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


def _model(**kwargs) -> TransformerDecoder:
    torch.manual_seed(0)
    args = ModelArgs(**{**_SHAPE, "intermediate_dim": 64, **kwargs})
    return TransformerDecoder(args).eval()


def test_gemma_rms_norm_scales_by_one_plus_weight_in_fp32():
    norm = RMSNorm(4, eps=0.0, unit_offset=True)
    assert torch.equal(norm.weight, torch.zeros(4))  # starts as the identity scale
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.0, 1.0, -0.5, 2.0]))
    x = torch.tensor([[2.0, -2.0, 2.0, -2.0]])  # rms 2
    assert torch.equal(norm(x), torch.tensor([[1.0, -2.0, 0.5, -3.0]]))
    # bf16 in, bf16 out, the scale applied before the cast (HF Gemma's order).
    x16 = torch.tensor([[1.0, 3.0, -1.0, 0.5]], dtype=torch.bfloat16)
    expected = x16.float() * torch.rsqrt(x16.float().pow(2).mean(-1, keepdim=True))
    expected = (expected * (1.0 + norm.weight)).to(torch.bfloat16)
    assert torch.equal(norm(x16), expected)


def test_attention_softcap_bounds_scores_and_is_exact_when_loose():
    torch.manual_seed(0)
    plain = Attention(16, 4, 2, 8)
    capped = Attention(16, 4, 2, 8, softcap=1e9)
    capped.load_state_dict(plain.state_dict())
    x = torch.randn(2, 7, 16) * 4
    rotary = RotaryEmbedding(8, 10000.0)(torch.arange(7).expand(2, 7), torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(capped(x, *rotary), plain(x, *rotary), rtol=0, atol=1e-5)
        capped.softcap = 1e-5  # scores within +-1e-5: attention is a plain average
        out = capped(x, *rotary)
        v = plain.v_proj(x).view(2, 7, 2, 8).repeat_interleave(2, dim=2)
        average = v.cumsum(1) / torch.arange(1, 8)[None, :, None, None]
        expected = plain.o_proj(average.reshape(2, 7, 32))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-3)


def test_final_logit_softcap():
    model = _model(final_logit_softcap=0.5)
    tokens = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        capped = model(tokens)
        model.args.final_logit_softcap = None
        raw = model(tokens)
    torch.testing.assert_close(capped, 0.5 * torch.tanh(raw / 0.5))
    assert capped.abs().max() < 0.5 < raw.abs().max()


@pytest.mark.parametrize("packed", [False, True])
def test_sliding_window_hides_keys_older_than_the_window(packed):
    # One sliding layer, window 3: the output at position t depends on tokens t-2..t only.
    model = _model(num_layers=1, sliding_window=3, layer_types=["sliding_attention"])
    tokens = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 2] = (tokens[0, 2] + 1) % 97
    kwargs = {}
    if packed:  # one document: the window combines with a document mask and positions
        kwargs = dict(mask=torch.ones(1, 10, 10, dtype=torch.bool).tril(),
                      input_pos=torch.arange(10)[None])  # fmt: skip
    with torch.no_grad():
        a, b = model(tokens, **kwargs), model(changed, **kwargs)
    differs = (a - b).abs().amax(-1)[0] > 1e-6
    assert differs.tolist() == [False, False, True, True, True] + [False] * 5


def test_kv_cache_with_window_equals_full_forward():
    model = _model(sliding_window=3, layer_types=["sliding_attention", "full_attention"])
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        model.setup_caches(batch_size=2, max_seq_len=12)
        steps = [model(tokens[:, :4], input_pos=torch.arange(4).expand(2, 4))]
        for position in range(4, 9):
            steps.append(model(tokens[:, position : position + 1],
                               input_pos=torch.tensor([[position]] * 2)))  # fmt: skip
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_partial_rotary_leaves_the_tail_features_alone():
    x = torch.randn(1, 2, 5, 8)
    cos, sin = RotaryEmbedding(6, 10000.0)(torch.arange(5)[None], torch.float32)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 6:], x[..., 6:])
    torch.testing.assert_close(out[..., :6], apply_rotary(x[..., :6], cos, sin))


def test_longrope_short_and_long_factors_and_attention_factor():
    scaling = {"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0],
               "factor": 4.0, "original_max_position_embeddings": 8}  # fmt: skip
    base = 1.0 / (100.0 ** torch.tensor([0.0, 0.5]))
    short = inverse_frequencies(4, 100.0, scaling)
    torch.testing.assert_close(short, base / torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(inverse_frequencies(4, 100.0, scaling, long=True),
                               base / torch.tensor([3.0, 4.0]))  # fmt: skip
    rope = RotaryEmbedding(4, 100.0, scaling)
    factor = math.sqrt(1 + math.log(4.0) / math.log(8))
    cos_short, _ = rope(torch.arange(8)[None], torch.float32)  # positions 0..7: short
    cos_long, _ = rope(torch.arange(9)[None], torch.float32)  # position 8 reached: long
    angle = 5 * base
    torch.testing.assert_close(
        cos_short[0, 5, :2], factor * torch.cos(angle / torch.tensor([1.0, 2.0]))
    )
    torch.testing.assert_close(
        cos_long[0, 5, :2], factor * torch.cos(angle / torch.tensor([3.0, 4.0]))
    )


def test_fused_projections_split_like_the_separate_ones():
    fused = _model(fused_projections=True)
    plain = _model()
    state = {}
    for name, value in plain.state_dict().items():
        state[name] = value
    for i in range(2):
        prefix = f"model.layers.{i}."
        attn = [state.pop(f"{prefix}self_attn.{p}_proj.weight") for p in "qkv"]
        state[f"{prefix}self_attn.qkv_proj.weight"] = torch.cat(attn)
        mlp = [state.pop(f"{prefix}mlp.{p}_proj.weight") for p in ("gate", "up")]
        state[f"{prefix}mlp.gate_up_proj.weight"] = torch.cat(mlp)
    fused.load_state_dict(state, strict=True)
    tokens = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens), plain(tokens), rtol=0, atol=1e-6)


# The same checkpoint as transformers 4 writes it (rope_theta / rope_scaling, extra top-level
# keys) and as transformers 5 does (rope_parameters, per layer kind for Gemma 3).
_LONGROPE = {"short_factor": [1.0] * 3, "long_factor": [2.0] * 3}
LAYOUTS = {
    "phi3": (
        dict(_HF_SHAPE, model_type="phi3", rope_theta=10000.0, partial_rotary_factor=0.75,
             max_position_embeddings=64, original_max_position_embeddings=16,
             rope_scaling={"type": "longrope", **_LONGROPE}),
        dict(_HF_SHAPE, model_type="phi3", max_position_embeddings=64,
             original_max_position_embeddings=16,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.75, **_LONGROPE,
                              "original_max_position_embeddings": 16}),
    ),
    "gemma3_text": (
        dict(_HF_SHAPE, model_type="gemma3_text", head_dim=8, rope_theta=1e6,
             rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
             sliding_window=4, sliding_window_pattern=2),
        dict(_HF_SHAPE, model_type="gemma3_text", head_dim=8, sliding_window=4,
             layer_types=["sliding_attention", "full_attention"],
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                 "rope_theta": 1e6}}),
    ),
    "qwen3": (
        dict(_HF_SHAPE, model_type="qwen3", head_dim=16, rope_theta=1e6, use_sliding_window=True,
             sliding_window=4, max_window_layers=1),
        dict(_HF_SHAPE, model_type="qwen3", head_dim=16, use_sliding_window=True,
             sliding_window=4, layer_types=["full_attention", "sliding_attention"],
             rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_transformers4_and_5_layouts_agree(family):
    old, new = LAYOUTS[family]
    args = args_from_hf(old)
    assert args_from_hf(new) == args and args.family == family
    if family == "phi3":
        assert args.rotary_dim == 6 and args.fused_projections and args.layer_types is None
        assert args.rope_scaling["factor"] == 4.0
        assert args.rope_scaling["original_max_position_embeddings"] == 16
    if family == "gemma3_text":
        assert args.layer_types == ["sliding_attention", "full_attention"]
        assert (args.rope_theta, args.rope_local_theta) == (1e6, 1e4)
        assert args.rope_scaling == {"rope_type": "linear", "factor": 8.0}
        assert args.norm_unit_offset and args.sandwich_norms and args.qk_norm
    if family == "qwen3":
        assert args.qk_norm and args.head_dim == 16 and args.sliding_window == 4


def test_family_defaults_for_configs_without_layer_types():
    gemma2 = args_from_hf(dict(_HF_SHAPE, model_type="gemma2", num_hidden_layers=4))
    assert gemma2.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert gemma2.tie_embeddings and gemma2.hidden_act == "gelu_pytorch_tanh"
    mistral = args_from_hf(dict(_HF_SHAPE, model_type="mistral", sliding_window=None))
    assert mistral.layer_types is None
    qwen3 = args_from_hf(dict(_HF_SHAPE, model_type="qwen3", sliding_window=4))
    assert qwen3.layer_types is None  # use_sliding_window is false


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(hidden_act="relu"), "hidden_act 'relu' is not supported"),
        (dict(layer_types=["full_attention"]), "layer_types must list 2 entries"),
        (dict(layer_types=["sliding_attention"] * 2), "need a positive sliding_window"),
        (dict(partial_rotary_factor=0.4), "partial_rotary_factor 0.4"),
    ],
)
def test_model_args_rejects_bad_family_fields(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelArgs(**{**_SHAPE, "intermediate_dim": 64, **change})


def test_unsupported_family_features_are_clear_errors():
    gemma3 = dict(_HF_SHAPE, model_type="gemma3_text", use_bidirectional_attention=True)
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        args_from_hf(gemma3)
    bad_factors = dict(LAYOUTS["phi3"][0], rope_scaling={"type": "longrope",
                       "short_factor": [1.0] * 5, "long_factor": [1.0] * 5})  # fmt: skip
    model = TransformerDecoder(args_from_hf(bad_factors))
    with pytest.raises(ConfigError, match="must have 3 entries"):
        model(torch.zeros(1, 3, dtype=torch.long))


def test_all_linear_lora_on_fused_phi3_modules_in_list_form():
    from tunelab.peft import apply_lora

    model = _model(fused_projections=True)
    swapped = apply_lora(
        model, LoRAArgs(targets=["all-linear"], rank=2, alpha=4.0)
    )  # the config form
    assert sorted({name.rpartition(".")[2] for name in swapped}) == [
        "down_proj", "gate_up_proj", "o_proj", "qkv_proj",
    ]  # fmt: skip


def test_an_moe_family_with_sandwich_norms_records_its_router_statistics():
    # Gemma's four norms per block once sent the MLP no router_stats: an MoE family with them
    # would have trained without its load-balancing loss, silently.
    from tunelab.modules.moe import RouterStats

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_dim=16)
    tokens = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    losses = {}
    for sandwich in (False, True):
        model = _model(sandwich_norms=sandwich, **moe)
        stats = RouterStats()
        model(tokens, router_stats=stats)
        assert stats.num_layers == 2
        losses[sandwich] = stats.loss()
    # Sandwich norms change what reaches the router, so the two losses differ.
    assert losses[True].item() > 0 and losses[True].item() != losses[False].item()
