"""tunelab models against transformers: HF files in, HF files out, same logits."""

import json

import pytest
import torch
from safetensors import safe_open

from tunelab.checkpoint import HFCheckpointReader
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.models import from_hf_config, load_pretrained

FAMILIES = ["llama3_2", "llama3_1", "qwen2"]
TOLERANCE = 1e-4


def _tokens(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab_size, (2, 17), generator=generator)


@torch.no_grad()
def _hf_logits(hf_model, tokens):
    return hf_model(tokens).logits


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_load_hf_checkpoint_matches_transformers(
    tiny_hf_model_dir, load_hf_causal_lm, family, sharded
):
    path = tiny_hf_model_dir(family, sharded)
    assert (path / "model.safetensors.index.json").exists() == sharded
    hf_model, _ = load_hf_causal_lm(path)
    model = load_pretrained(path)
    tokens = _tokens(model.args.vocab_size)
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == (2, 17, model.args.vocab_size)
    assert (logits - _hf_logits(hf_model, tokens)).abs().max() <= TOLERANCE
    # Far positions, where the llama3 rule rescales the low frequencies.
    positions = torch.arange(20000, 20017).expand(2, 17)
    with torch.no_grad():
        far = model(tokens, input_pos=positions)
        expected = hf_model(tokens, position_ids=positions).logits
    assert (far - expected).abs().max() <= TOLERANCE
    assert model.args.family == ("qwen2" if family == "qwen2" else "llama")
    if model.args.tie_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("max_shard_size", ["5GB", 40_000], ids=["single", "sharded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_loads_in_transformers(
    tiny_hf_model_dir, load_hf_causal_lm, tmp_path, family, max_shard_size
):
    source = tiny_hf_model_dir(family)
    model = load_pretrained(source)
    output = tmp_path / "export"
    hf_state = model.state_dict_adapter.to_hf(model.state_dict())
    save_hf_sharded(
        hf_state,
        output,
        source_dir=source,
        torch_dtype=torch.float32,
        max_shard_size=max_shard_size,
    )

    files = sorted(p.name for p in output.glob("*.safetensors"))
    if max_shard_size == "5GB":
        assert files == ["model.safetensors"]
        assert not (output / "model.safetensors.index.json").exists()
    else:
        assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        index = json.loads((output / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(files)
        assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in hf_state.values())
    for name in files:
        with safe_open(output / name, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert ("lm_head.weight" in HFCheckpointReader(output)) == (not model.args.tie_embeddings)
    config = json.loads((output / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert (output / "generation_config.json").exists()

    hf_model, info = load_hf_causal_lm(output)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    tokens = _tokens(model.args.vocab_size)
    with torch.no_grad():
        expected = model(tokens)
    assert (_hf_logits(hf_model, tokens) - expected).abs().max() <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_config_written_by_adapter_round_trips(
    tiny_hf_model_dir, load_hf_causal_lm, tmp_path, family
):
    """A config made by the family adapter alone (no source dir) loads in transformers."""
    model = load_pretrained(tiny_hf_model_dir(family))
    adapter = model.state_dict_adapter
    config = adapter.hf_config(torch.float32)
    save_hf_sharded(adapter.to_hf(model.state_dict()), tmp_path / "out")
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    assert from_hf_config(tmp_path / "out").args == model.args
    hf_model, info = load_hf_causal_lm(tmp_path / "out")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokens = _tokens(model.args.vocab_size)
    with torch.no_grad():
        assert (_hf_logits(hf_model, tokens) - model(tokens)).abs().max() <= TOLERANCE


def test_kv_cache_generation_matches_transformers_greedy(tiny_hf_model_dir, load_hf_causal_lm):
    path = tiny_hf_model_dir("llama3_2")
    hf_model, _ = load_hf_causal_lm(path)
    model = load_pretrained(path)
    prompt = _tokens(model.args.vocab_size)[:1, :5]
    model.setup_caches(batch_size=1, max_seq_len=16)
    tokens = prompt
    with torch.no_grad():
        logits = model(prompt, input_pos=torch.arange(5)[None])
        for step in range(6):
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
            logits = model(next_token, input_pos=torch.tensor([[5 + step]]))
        expected = hf_model.generate(
            prompt, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt)
        )
    assert torch.equal(tokens, expected)
