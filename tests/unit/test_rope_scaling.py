"""RoPE scaling types from real configs: YaRN's rule by hand, the ``su`` alias, how missing
YaRN/LongRoPE keys resolve from the config's top level, and the refusals (dynamic NTK, unknown
types). The comparisons with transformers are in tests/interop/test_rope_scaling_hf.py."""

import math

import pytest
import torch

from tunelab.errors import ConfigError
from tunelab.models import ModelArgs, args_from_hf
from tunelab.modules.rotary import RotaryEmbedding, attention_factor_of, inverse_frequencies

_HF = dict(model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=64,
           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip


def test_yarn_keeps_fast_pairs_divides_slow_ones_and_ramps_between():
    # head_dim 8, theta 10, original length 16: the pair index with beta turns over the
    # original length is d(beta) = 8 ln(16 / (2 pi beta)) / (2 ln 10); d(2) = 0.42 -> 0 and
    # d(0.5) = 2.83 -> 3 once truncated to whole pairs.
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
               "beta_fast": 2.0, "beta_slow": 0.5}  # fmt: skip
    base = 1.0 / 10.0 ** torch.arange(0, 8, 2).div(8)
    ramp = torch.tensor([0.0, 1 / 3, 2 / 3, 1.0])  # pairs 0..3 over the bounds [0, 3]
    torch.testing.assert_close(
        inverse_frequencies(8, 10.0, scaling), base * (1 - ramp) + base / 4 * ramp
    )
    # truncate False keeps the bounds [0.42, 2.83].
    low = 8 * math.log(16 / (2 * math.pi * 2.0)) / (2 * math.log(10))
    high = 8 * math.log(16 / (2 * math.pi * 0.5)) / (2 * math.log(10))
    assert (round(low, 2), round(high, 2)) == (0.42, 2.83)
    ramp = torch.tensor([0.0, (1 - low) / (high - low), (2 - low) / (high - low), 1.0])
    torch.testing.assert_close(
        inverse_frequencies(8, 10.0, {**scaling, "truncate": False}),
        base * (1 - ramp) + base / 4 * ramp,
    )


def test_yarn_attention_factor_and_its_overrides():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    assert attention_factor_of(scaling) == pytest.approx(0.1 * math.log(4.0) + 1)
    ratio = (0.1 * 0.9 * math.log(4.0) + 1) / (0.1 * 0.7 * math.log(4.0) + 1)
    both = {**scaling, "mscale": 0.9, "mscale_all_dim": 0.7}
    assert attention_factor_of(both) == pytest.approx(ratio)
    assert attention_factor_of({**both, "attention_factor": 1.25}) == 1.25
    assert attention_factor_of({**scaling, "factor": 1.0}) == 1.0
    cos, sin = RotaryEmbedding(8, 10.0, scaling)(torch.zeros(1, 1, dtype=torch.long), torch.float32)
    assert torch.equal(cos, torch.full((1, 1, 8), attention_factor_of(scaling)))


def test_yarn_and_longrope_keys_resolve_from_the_config():
    # The model cards' snippet: the type under "type", every length given.
    card = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    args = args_from_hf({**_HF, "max_position_embeddings": 32768, "rope_scaling": card})
    assert args.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 32768}  # fmt: skip
    # No original length: the top level's, else max_position_embeddings; no factor: the ratio.
    bare = {"rope_type": "yarn"}
    args = args_from_hf({**_HF, "max_position_embeddings": 64, "rope_scaling": bare,
                         "original_max_position_embeddings": 16})  # fmt: skip
    assert args.rope_scaling["original_max_position_embeddings"] == 16
    assert args.rope_scaling["factor"] == 4.0
    args = args_from_hf({**_HF, "max_position_embeddings": 64,
                         "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})  # fmt: skip
    assert args.rope_scaling["original_max_position_embeddings"] == 64


@pytest.mark.parametrize("name", ["su", "yarn"])
def test_old_phi3_names_are_longrope(name):
    # transformers' Phi3Config reads both older names as LongRoPE.
    scaling = {"type": name, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    config = {**_HF, "model_type": "phi3", "max_position_embeddings": 64,
              "original_max_position_embeddings": 16, "rope_scaling": scaling}  # fmt: skip
    args = args_from_hf(config)
    assert args.rope_scaling == {
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 16, "factor": 4.0,
    }  # fmt: skip
    # Hand-built: the module takes the alias, and ModelArgs writes it as the name it means
    # (what the KV-cache re-encoding and the Phi-3 export check).
    direct = {**{k: v for k, v in args.rope_scaling.items() if k != "rope_type"}, "type": "su"}
    assert RotaryEmbedding(16, 10000.0, direct).attention_factor == pytest.approx(
        math.sqrt(1 + math.log(4.0) / math.log(16))
    )
    assert ModelArgs(**{**vars(args), "rope_scaling": direct}).rope_scaling == args.rope_scaling


def test_dynamic_ntk_is_refused_with_the_reason():
    config = {**_HF, "max_position_embeddings": 64,
              "rope_scaling": {"type": "dynamic", "factor": 2.0}}  # fmt: skip
    with pytest.raises(ConfigError, match="'dynamic'.*inference-time extrapolation") as error:
        args_from_hf(config)
    assert "'yarn'" in str(error.value)


def test_unknown_rope_type_names_it_and_the_supported_ones():
    with pytest.raises(ConfigError, match="'mrope' is not supported") as error:
        RotaryEmbedding(8, 10000.0, {"rope_type": "mrope"})
    for name in ("default", "linear", "llama3", "longrope", "yarn", "su"):
        assert repr(name) in str(error.value)
