"""Building blocks, checked against values worked out by hand."""

import math

import pytest
import torch

from tunelab.errors import ConfigError
from tunelab.modules import (
    FeedForward,
    RMSNorm,
    RotaryEmbedding,
    causal_mask,
    document_causal_mask,
    padding_mask,
    positions_from_document_ids,
)
from tunelab.modules.rotary import apply_rotary, inverse_frequencies


def test_rmsnorm_hand_values():
    norm = RMSNorm(2, eps=0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0]))
    # rms([3, 4]) = sqrt(12.5) = 3.5355339
    out = norm(torch.tensor([[3.0, 4.0]]))
    torch.testing.assert_close(out, torch.tensor([[0.8485281, 2.2627417]]))


def test_swiglu_hand_value():
    mlp = FeedForward(1, 1)
    with torch.no_grad():
        mlp.gate_proj.weight.fill_(1.0)
        mlp.up_proj.weight.fill_(2.0)
        mlp.down_proj.weight.fill_(3.0)
    # 3 * silu(1) * 2 = 6 / (1 + e^-1)
    torch.testing.assert_close(mlp(torch.ones(1, 1)), torch.tensor([[6 / (1 + math.exp(-1))]]))


def test_inverse_frequencies_default():
    torch.testing.assert_close(inverse_frequencies(4, 100.0), torch.tensor([1.0, 0.1]))


def test_inverse_frequencies_llama3_rule_all_three_bands():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1000,
    }
    # inv_freq [1, 0.1, 0.01, 0.001], wavelengths [6.3, 62.8, 628.3, 6283]; bands at 250 and 1000:
    # high, high, medium (s = (1000/628.3 - 1) / 3 = 0.197183), low (divided by 8).
    expected = torch.tensor([1.0, 0.1, (1 - 0.197183) * 0.01 / 8 + 0.197183 * 0.01, 0.001 / 8])
    torch.testing.assert_close(
        inverse_frequencies(8, 10000.0, scaling), expected, rtol=1e-5, atol=0
    )


def test_inverse_frequencies_linear_and_legacy_type_key():
    out = inverse_frequencies(4, 100.0, {"type": "linear", "factor": 2.0})
    torch.testing.assert_close(out, torch.tensor([0.5, 0.05]))


def test_rope_rejects_unsupported_type_and_missing_keys():
    with pytest.raises(ConfigError, match="'mrope' is not supported"):
        RotaryEmbedding(8, 10000.0, {"rope_type": "mrope", "factor": 4.0})
    with pytest.raises(ConfigError, match="needs the key 'low_freq_factor'"):
        inverse_frequencies(8, 10000.0, {"rope_type": "llama3", "factor": 8.0})


def test_rotary_rotates_a_pair_by_position_angle():
    rope = RotaryEmbedding(head_dim=2, theta=10000.0)  # one pair, inv_freq = 1
    positions = torch.tensor([[0, 1, 2]])
    cos, sin = rope(positions, torch.float32)
    x = torch.tensor([1.0, 0.0]).expand(1, 1, 3, 2)  # [batch, heads, seq, head_dim]
    out = apply_rotary(x, cos, sin)
    expected = torch.tensor([[math.cos(p), math.sin(p)] for p in (0, 1, 2)])
    torch.testing.assert_close(out[0, 0], expected)


def test_rotary_has_no_buffers_so_meta_build_is_safe():
    assert list(RotaryEmbedding(8, 10000.0).buffers()) == []


def test_causal_mask():
    assert causal_mask(3).tolist() == [
        [True, False, False],
        [True, True, False],
        [True, True, True],
    ]


def test_padding_mask_left_padding_keeps_diagonal():
    mask = padding_mask(torch.tensor([[False, True, True]]))
    assert mask[0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]


def test_document_causal_mask_and_positions():
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    T, F = True, False
    assert document_causal_mask(ids)[0].tolist() == [
        [T, F, F, F, F],
        [T, T, F, F, F],
        [F, F, T, F, F],
        [F, F, T, T, F],
        [F, F, T, T, T],
    ]
    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert positions_from_document_ids(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_mask_helpers_reject_bad_shapes():
    with pytest.raises(ValueError, match="bool"):
        padding_mask(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        document_causal_mask(torch.zeros(3, dtype=torch.long))
