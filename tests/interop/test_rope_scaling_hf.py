"""YaRN and the ``su`` name of LongRoPE against transformers: cos/sin tables and whole models.

The configs are written as users meet them: the Qwen2.5/Qwen3 model cards' YaRN snippet
(legacy ``type`` key), a Llama config carrying every optional YaRN key, one relying on the
defaults (no ``original_max_position_embeddings``: it is ``max_position_embeddings``), and an
old Phi-3 config naming LongRoPE ``su``. Positions run below and past the original length.
"""

import json

import pytest
import torch

from tests.conftest import build_tiny_hf_model
from tunelab.models import args_from_hf, load_pretrained
from tunelab.modules.rotary import RotaryEmbedding

transformers = pytest.importorskip("transformers")

# Positions on both sides of each config's original length (8192, 16, 32768).
POSITIONS = torch.tensor([[0, 1, 5, 15, 16, 17, 100, 8191, 8192, 9000, 32767, 32768, 131071]])
YARN = {
    # The model cards' snippet, verbatim, on a Qwen2 of head_dim 16 and theta 1e6: the ramp
    # spans pairs 2..5 of 8, so every band of the rule is exercised.
    "qwen2_card": (
        "Qwen2Config",
        dict(rope_theta=1000000.0, max_position_embeddings=32768,
             rope_scaling={"type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 32768}),
    ),
    # Every optional key, no truncation, DeepSeek-style mscale ratio.
    "llama_all_keys": (
        "LlamaConfig",
        dict(rope_theta=10000.0, max_position_embeddings=131072,
             rope_scaling={"rope_type": "yarn", "factor": 16.0,
                           "original_max_position_embeddings": 8192, "beta_fast": 16.0,
                           "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.7,
                           "truncate": False}),
    ),
    # attention_factor given; original length defaults to max_position_embeddings (16).
    "llama_defaults": (
        "LlamaConfig",
        dict(rope_theta=500.0, max_position_embeddings=16,
             rope_scaling={"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3}),
    ),
}  # fmt: skip
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
PHI3_SU = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75,
    max_position_embeddings=48, original_max_position_embeddings=12,
    rope_scaling={"type": "su", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                  "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]},
)  # fmt: skip
MODEL_TYPES = {"Qwen2Config": "qwen2", "LlamaConfig": "llama", "Phi3Config": "phi3"}


def _hf_rotary(config):
    """transformers' rotary module for ``config``, the one its model builds."""
    return transformers.AutoModel.from_config(config).rotary_emb


def _user_config(config_class: str, kwargs: dict) -> dict:
    """The config.json a user edits: the kwargs as written, plus ``model_type``."""
    return {"model_type": MODEL_TYPES[config_class], "vocab_size": 97, "intermediate_size": 128,
            "num_hidden_layers": 1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            **SHAPE, **kwargs}  # fmt: skip


def _assert_tables_equal(ours: RotaryEmbedding, hf_rotary, positions: torch.Tensor) -> None:
    cos, sin = ours(positions, torch.float32)
    hf_cos, hf_sin = hf_rotary(torch.zeros(1), positions)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


def _rotary_of(config: dict) -> RotaryEmbedding:
    args = args_from_hf(config)
    return RotaryEmbedding(args.rotary_dim, args.rope_theta, args.rope_scaling)


@pytest.mark.parametrize("name", sorted(YARN))
def test_yarn_cos_sin_equal_transformers(name, tmp_path):
    config_class, kwargs = YARN[name]
    user = _user_config(config_class, kwargs)
    hf_config = getattr(transformers, config_class)(**user)
    hf_rotary = _hf_rotary(hf_config)
    assert hf_rotary.rope_type == "yarn" and hf_rotary.attention_scaling != 1.0
    _assert_tables_equal(_rotary_of(user), hf_rotary, POSITIONS)
    # The file transformers writes back (rope_parameters in 5.x) reads the same.
    hf_config.save_pretrained(tmp_path)
    _assert_tables_equal(_rotary_of(tmp_path), hf_rotary, POSITIONS)


def test_su_is_longrope_and_equals_transformers():
    user = _user_config("Phi3Config", PHI3_SU)
    args = args_from_hf(user)
    assert args.rope_scaling["rope_type"] == "longrope"
    ours = _rotary_of(user)
    # transformers 5 renames "su" only after filling in the original length, then fails on
    # its absence (KeyError), so the reference gets the name "su" stands for.
    renamed = {**user, "rope_scaling": {**user["rope_scaling"], "type": "longrope"}}
    hf_rotary = _hf_rotary(transformers.Phi3Config(**renamed))
    for length in (12, 13, 40):  # the long factors from length 13 on
        _assert_tables_equal(ours, hf_rotary, torch.arange(length)[None])


def _tokens(seq_len: int) -> torch.Tensor:
    return torch.randint(0, 301, (2, seq_len), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("family", "overrides", "offsets"),
    [
        # The model cards' YaRN on a Qwen2; positions start just before 32768 and cross it.
        ("qwen2", dict(max_position_embeddings=32768, **{"rope_scaling": YARN["qwen2_card"][1]
                                                          ["rope_scaling"]}), (0, 32760)),
        # Every optional key on a Llama; 24 tokens cross the original length 16 (betas
        # set so the ramp spans pairs 1.2..5.1 of 8 at this short length).
        ("llama3_1", dict(max_position_embeddings=64, rope_theta=500.0,
                          rope_scaling={**YARN["llama_all_keys"][1]["rope_scaling"],
                                        "original_max_position_embeddings": 16,
                                        "beta_fast": 1.0, "beta_slow": 0.05}), (0,)),
        # conftest's Phi-3 has LongRoPE with original length 12; its file gets the name "su".
        ("phi3", {}, (0,)),
    ],
    ids=["qwen2_yarn_card", "llama_yarn_all_keys", "phi3_su"],
)  # fmt: skip
def test_logits_match_transformers(family, overrides, offsets, tmp_path):
    hf_model = build_tiny_hf_model(family, **overrides).eval()
    hf_model.save_pretrained(tmp_path)
    if family == "phi3":  # transformers saves the new name; put back the one old files have
        config = (tmp_path / "config.json").read_text()
        (tmp_path / "config.json").write_text(config.replace('"longrope"', '"su"'))
    model = load_pretrained(tmp_path)
    assert model.args.rope_scaling["rope_type"] in ("yarn", "longrope")
    for offset in offsets:
        tokens = _tokens(24)
        positions = (offset + torch.arange(24)).expand(2, 24)
        with torch.no_grad():
            ours = model(tokens, input_pos=positions)
            theirs = hf_model(tokens, position_ids=positions).logits
        assert float((ours - theirs).abs().max()) <= 1e-4, (family, offset)
    # The config.json tunelab exports reads back the same, in tunelab and in transformers.
    written = tmp_path / "written"
    written.mkdir()
    (written / "config.json").write_text(json.dumps(model.state_dict_adapter.hf_config()))
    assert args_from_hf(written) == model.args
    hf_rotary = _hf_rotary(transformers.AutoConfig.from_pretrained(written))
    _assert_tables_equal(model.model.rotary_emb, hf_rotary, positions)
