"""The decoder: structure, published sizes, masks, KV cache, tied weights, HF config parsing."""

import pytest
import torch

from tunelab.errors import CheckpointError, ConfigError
from tunelab.models import (
    ModelArgs,
    TransformerDecoder,
    args_from_hf,
    from_hf_config,
)
from tunelab.modules import document_causal_mask, padding_mask, positions_from_document_ids

VOCAB = 97


def tiny(tie: bool = False, family: str = "llama", **kwargs) -> TransformerDecoder:
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_dim=64,
        tie_embeddings=tie, family=family, qkv_bias=family == "qwen2", **kwargs,
    )  # fmt: skip
    model = TransformerDecoder(args).eval()
    with torch.no_grad():  # sharper attention than the default init, so masking errors show
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return model


def test_module_tree_mirrors_hf_llama():
    keys = list(tiny(tie=False).state_dict())
    layer = [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    ]  # fmt: skip
    expected = ["model.embed_tokens.weight"]
    expected += [f"model.layers.{i}.{name}" for i in range(2) for name in layer]
    expected += ["model.norm.weight", "lm_head.weight"]
    assert keys == expected


def test_qwen2_has_qkv_bias_only():
    names = {n for n, _ in tiny(family="qwen2").named_parameters() if n.endswith("bias")}
    assert names == {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"}


# The published config.json values of each size (only the keys the parameter count and the
# rope rule depend on).
_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama(**config):
    return {"model_type": "llama", "rms_norm_eps": 1e-5, **config}


def _llama3(**config):
    return _llama(vocab_size=128256, num_key_value_heads=8, rope_theta=500000.0, **config)


def _qwen2_5(**config):
    return {"model_type": "qwen2", "vocab_size": 151936, "rms_norm_eps": 1e-6, **config}


PUBLISHED_CONFIGS = {
    "llama2_7b": _llama(
        vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, intermediate_size=11008, max_position_embeddings=4096,
    ),
    "llama3_8b": _llama3(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=14336,
        max_position_embeddings=8192,
    ),
    "llama3_1_8b": _llama3(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=14336,
        rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072,
    ),
    "llama3_1_70b": _llama3(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672,
        rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072,
    ),
    "llama3_2_1b": _llama3(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64,
        intermediate_size=8192, rope_scaling={**_LLAMA3_SCALING, "factor": 32.0},
        max_position_embeddings=131072, tie_word_embeddings=True,
    ),
    "llama3_2_3b": _llama3(
        hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128,
        intermediate_size=8192, rope_scaling={**_LLAMA3_SCALING, "factor": 32.0},
        max_position_embeddings=131072, tie_word_embeddings=True,
    ),
    "qwen2_5_0_5b": _qwen2_5(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, tie_word_embeddings=True,
    ),
    "qwen2_5_1_5b": _qwen2_5(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, tie_word_embeddings=True,
    ),
    "qwen2_5_7b": _qwen2_5(
        vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False,
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "name, num_params, tied",
    [
        ("llama2_7b", 6_738_415_616, False),
        ("llama3_8b", 8_030_261_248, False),
        ("llama3_1_8b", 8_030_261_248, False),
        ("llama3_1_70b", 70_553_706_496, False),
        ("llama3_2_1b", 1_235_814_400, True),
        ("llama3_2_3b", 3_212_749_824, True),
        ("qwen2_5_0_5b", 494_032_768, True),
        ("qwen2_5_1_5b", 1_543_714_304, True),
        ("qwen2_5_7b", 7_615_616_512, False),
    ],
)
def test_published_configs_match_published_parameter_counts_on_meta(name, num_params, tied):
    with torch.device("meta"):
        model = from_hf_config(PUBLISHED_CONFIGS[name])
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == num_params  # model-card counts
    assert model.args.tie_embeddings == tied
    assert len(list(model.layers)) == model.args.num_layers


def test_llama3_2_rope_scaling():
    args = args_from_hf(PUBLISHED_CONFIGS["llama3_2_1b"])
    assert args.rope_theta == 500000.0
    assert args.rope_scaling["factor"] == 32.0 and args.rope_scaling["rope_type"] == "llama3"


def test_tie_survives_meta_to_empty():
    with torch.device("meta"):
        model = tiny(tie=True)
    model.to_empty(device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(list(model.parameters())) == 1 + 2 * 9 + 1  # lm_head not counted twice


def test_forward_shape_and_4d_mask_equals_3d_and_causal():
    model = tiny()
    tokens = torch.randint(0, VOCAB, (2, 6))
    mask = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 6, 6)
    with torch.no_grad():
        causal = model(tokens)
        three_d = model(tokens, mask=mask)
        four_d = model(tokens, mask=mask[:, None])
    assert causal.shape == (2, 6, VOCAB)
    torch.testing.assert_close(three_d, causal)
    torch.testing.assert_close(four_d, causal)


def test_document_mask_packing_equals_separate_runs():
    model = tiny(family="qwen2")
    first, second = torch.randint(0, VOCAB, (1, 5)), torch.randint(0, VOCAB, (1, 7))
    packed = torch.cat([first, second], dim=1)
    ids = torch.tensor([[0] * 5 + [1] * 7])
    with torch.no_grad():
        out = model(
            packed, mask=document_causal_mask(ids), input_pos=positions_from_document_ids(ids)
        )
        naive = model(packed)  # without the mask the second document sees the first
        torch.testing.assert_close(out[:, :5], model(first), atol=1e-5, rtol=0)
        torch.testing.assert_close(out[:, 5:], model(second), atol=1e-5, rtol=0)
    assert (naive[:, 5:] - out[:, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_equals_unpadded(side):
    model = tiny()
    tokens = torch.randint(0, VOCAB, (1, 6))
    pad = torch.zeros(1, 3, dtype=torch.long)
    padded = torch.cat([pad, tokens] if side == "left" else [tokens, pad], dim=1)
    real = slice(3, 9) if side == "left" else slice(0, 6)
    valid = torch.zeros(padded.shape, dtype=torch.bool)
    valid[:, real] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(padded, mask=padding_mask(valid), input_pos=positions)
        torch.testing.assert_close(out[:, real], model(tokens), atol=1e-5, rtol=0)
        assert torch.isfinite(out).all()


def test_kv_cache_steps_equal_full_forward():
    model = tiny(tie=True, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    })  # fmt: skip
    tokens = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        full = model(tokens)
        model.setup_caches(batch_size=2, max_seq_len=12)
        for _ in range(2):  # the second round proves reset_caches
            model.reset_caches()
            steps = [model(tokens[:, :4], input_pos=torch.arange(4).expand(2, 4))]
            for pos in range(4, 9):
                steps.append(model(tokens[:, pos : pos + 1], input_pos=torch.full((2, 1), pos)))
            torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=0)
        assert model.caches_are_enabled()
        assert "k_cache" not in str(list(model.state_dict()))
        with pytest.raises(ValueError, match="input_pos is required"):
            model(tokens)
        model.teardown_caches()
        torch.testing.assert_close(model(tokens), full)


@pytest.mark.parametrize("layer_types", [None, ("sliding_attention", "full_attention")])
def test_a_kv_cache_mask_over_the_filled_slots_reads_only_those(layer_types):
    # A mask narrower than the cache: attention reads its first slots only. The rest hold NaN
    # here, which any read would spread (0 x NaN), and the logits equal the full-width mask's.
    extra = {"layer_types": layer_types, "sliding_window": 3} if layer_types else {}
    model = tiny(**extra)
    tokens = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        model.setup_caches(batch_size=2, max_seq_len=16)
        model(tokens[:, :5], input_pos=torch.arange(5).expand(2, 5))
        for layer in model.layers:
            layer.self_attn.kv_cache.k_cache[:, :, 6:] = float("nan")
            layer.self_attn.kv_cache.v_cache[:, :, 6:] = float("nan")
        position = torch.full((2, 1), 5)
        narrow = torch.arange(6)[None, None, :] <= position[:, :, None]
        got = model(tokens[:, 5:], input_pos=position, mask=narrow)
        model.teardown_caches()
        full = model(tokens)[:, 5:]
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, full, atol=1e-5, rtol=0)


def test_forward_rejects_bad_inputs():
    model = tiny()
    with pytest.raises(ValueError, match=r"tokens must be \[batch, seq\]"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="bool"):
        model(torch.zeros(1, 3, dtype=torch.long), mask=torch.ones(1, 3, 3))
    with pytest.raises(ValueError, match="input_pos shape"):
        model(torch.zeros(1, 3, dtype=torch.long), input_pos=torch.zeros(1, 2, dtype=torch.long))


def test_model_args_validation():
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        ModelArgs(
            vocab_size=8, dim=32, num_layers=1, num_heads=4, num_kv_heads=3, intermediate_dim=8
        )
    assert ModelArgs(8, 32, 1, 4, 2, 8).head_dim == 8


HF_LLAMA = {
    "model_type": "llama", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_theta": 500000.0,
    "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}  # fmt: skip


def test_from_hf_config_transformers4_and_5_layouts_agree():
    v4 = args_from_hf(HF_LLAMA)
    v5 = {k: v for k, v in HF_LLAMA.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": 500000.0, **HF_LLAMA["rope_scaling"]}
    assert args_from_hf(v5) == v4
    assert v4.head_dim == 8 and v4.tie_embeddings and v4.rope_scaling["factor"] == 32.0


def test_from_hf_config_picks_family_by_architecture(tmp_path):
    config = {k: v for k, v in HF_LLAMA.items() if k != "model_type"}
    config["architectures"] = ["Qwen2ForCausalLM"]
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    model = from_hf_config(tmp_path)
    assert model.args.family == "qwen2" and model.args.qkv_bias


def test_from_hf_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unsupported model: model_type='gpt2'") as error:
        from_hf_config({**HF_LLAMA, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    for family in ("gemma2", "gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3"):
        assert repr(family) in str(error.value)
    with pytest.raises(ConfigError, match="'mrope' is not supported"):
        from_hf_config({**HF_LLAMA, "rope_scaling": {"rope_type": "mrope", "factor": 4.0}})
    with pytest.raises(ConfigError, match="no 'hidden_size'"):
        from_hf_config({k: v for k, v in HF_LLAMA.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="sliding_window"):
        from_hf_config({**HF_LLAMA, "model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(CheckpointError, match="config.json not found"):
        from_hf_config(tmp_path)


def test_state_dict_adapter_tied_head():
    model = tiny(tie=True)
    adapter = model.state_dict_adapter
    hf = adapter.to_hf(model.state_dict())
    assert "lm_head.weight" not in hf and "model.embed_tokens.weight" in hf
    embedding = hf["model.embed_tokens.weight"]
    assert "lm_head.weight" not in adapter.from_hf({**hf, "lm_head.weight": embedding.clone()})
    with pytest.raises(
        CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"
    ):
        adapter.from_hf({**hf, "lm_head.weight": embedding + 1})
    untied = tiny(tie=False)
    assert "lm_head.weight" in untied.state_dict_adapter.to_hf(untied.state_dict())


def test_the_kv_cache_writes_each_rows_slots_as_an_indexed_assignment():
    # The flat index_copy_ path (CPU, eager) against the assignment it replaces: prefill rows
    # of several slots, then one slot per row at ragged positions, every head's values.
    from tunelab.modules import KVCache

    cache = KVCache(3, 2, 10, 4, dtype=torch.float32)
    expected = torch.zeros(2, 3, 2, 10, 4)
    generator = torch.Generator().manual_seed(0)
    for positions in (torch.arange(5).expand(3, 5), torch.tensor([[5], [9], [6]])):
        k = torch.randn(3, 2, positions.shape[1], 4, generator=generator)
        v = torch.randn(3, 2, positions.shape[1], 4, generator=generator)
        k_cache, v_cache = cache.update(positions, k, v)
        rows = torch.arange(3)[:, None]
        expected[0][rows, :, positions] = k.transpose(1, 2)
        expected[1][rows, :, positions] = v.transpose(1, 2)
        assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])
    cache.select_rows(torch.tensor([2, 0]))  # the write index follows the rows
    k = torch.randn(2, 2, 1, 4, generator=generator)
    k_cache, _ = cache.update(torch.tensor([[7], [8]]), k, k)
    assert torch.equal(k_cache[0, :, 7], k[0, :, 0]) and torch.equal(k_cache[1, :, 8], k[1, :, 0])
    assert torch.equal(k_cache[0, :, :7], expected[0][2, :, :7])


def test_a_cached_forward_past_the_cache_is_refused():
    model = tiny()
    model.setup_caches(2, 8)
    tokens = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad():
        model(tokens, input_pos=torch.tensor([[3], [7]]))  # the last slot
        with pytest.raises(ValueError, match="reaches slot 8, past the KV cache's 8 slots"):
            model(tokens, input_pos=torch.tensor([[3], [8]]))
