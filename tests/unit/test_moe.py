"""Mixture-of-experts building blocks: grouped matmuls, experts, router loss, key mapping."""

import pytest
import torch

from tunelab.errors import ConfigError
from tunelab.models import ModelArgs, TransformerDecoder, args_from_hf
from tunelab.models.qwen3_moe import dense_layers_from_hf
from tunelab.modules import MoEBlock, MoEExperts, RouterStats, grouped_linear
from tunelab.modules.moe import _grouped_mm_available


def _loop_linear(rows, weight, counts):
    """The per-group Python loop that ``grouped_linear`` replaces."""
    outputs, start = [], 0
    for group, count in enumerate(counts.tolist()):
        outputs.append(rows[start : start + count] @ weight[group].T)
        start += count
    return torch.cat(outputs)


@pytest.mark.parametrize("grouped", [True, False])
def test_grouped_linear_equals_a_loop_forward_and_backward(grouped):
    """``grouped_mm`` (rows of 32 and 48 bytes) and the padded ``bmm`` alike."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1, 0, 4])  # empty groups too
    rows = torch.randn(int(counts.sum()), 8, generator=generator, requires_grad=True)
    weight = torch.randn(6, 12, 8, generator=generator, requires_grad=True)
    grad = torch.randn(int(counts.sum()), 12, generator=generator)
    ours = grouped_linear(rows, weight, counts, grouped=grouped)
    ours.backward(grad)
    ours_grads = rows.grad.clone(), weight.grad.clone()
    rows.grad = weight.grad = None
    reference = _loop_linear(rows, weight, counts)
    reference.backward(grad)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_grads[0], rows.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_grads[1], weight.grad, rtol=0, atol=1e-5)
    assert ours_grads[1][1].abs().sum() == 0  # an expert without tokens gets no gradient
    assert _grouped_mm_available(rows, weight)


def test_experts_equal_each_token_through_its_experts():
    torch.manual_seed(0)
    experts = MoEExperts(dim=6, intermediate_dim=4, num_experts=5)  # rows of 24 B: the bmm
    x = torch.randn(7, 6)
    top_indices = torch.randint(0, 5, (7, 2))
    top_indices[:, 1] = (top_indices[:, 0] + 1) % 5  # two distinct experts per token
    top_weights = torch.rand(7, 2)
    expected = torch.zeros(7, 6)
    assert not _grouped_mm_available(x, experts.down_proj)
    for token in range(7):
        for slot in range(2):
            expert = int(top_indices[token, slot])
            gate, up = (experts.gate_up_proj[expert] @ x[token]).chunk(2)
            hidden = torch.nn.functional.silu(gate) * up
            expected[token] += top_weights[token, slot] * (experts.down_proj[expert] @ hidden)
    with torch.no_grad():
        torch.testing.assert_close(experts(x, top_weights, top_indices), expected)


def test_router_renormalises_top_k_only_when_asked():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 4)
    for normalize in (True, False):
        block = MoEBlock(4, 3, num_experts=4, top_k=2, normalize_top_k=normalize)
        probabilities, weights, indices = block.route(x.reshape(-1, 4))
        torch.testing.assert_close(probabilities.sum(-1), torch.ones(3))
        top = probabilities.gather(-1, indices)
        expected = top / top.sum(-1, keepdim=True) if normalize else top
        torch.testing.assert_close(weights, expected)
        assert torch.allclose(weights.sum(-1), torch.ones(3)) == normalize


def test_router_stats_loss_by_hand():
    """Two experts, top-1, two layers, the third token padding.

    Layer 1: probabilities [.8, .2], [.4, .6] (pad [.5, .5]); layer 2: [.9, .1], [.7, .3].
    Counted tokens 4: f = [3/4, 1/4], P = [(.8+.4+.9+.7)/4, (.2+.6+.1+.3)/4] = [.7, .3];
    loss = 2 * (.75 * .7 + .25 * .3) = 1.2.
    """
    stats = RouterStats(valid=torch.tensor([[1, 1, 0]]))
    layer_1 = torch.tensor([[0.8, 0.2], [0.4, 0.6], [0.5, 0.5]])
    layer_2 = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.1, 0.9]])
    for probabilities in (layer_1, layer_2):
        stats.add(probabilities, probabilities.argmax(-1, keepdim=True))
    assert stats.num_layers == 2
    assert stats.loss().item() == pytest.approx(1.2)
    assert RouterStats().loss().item() == 0.0


def test_dense_layers_from_the_sparse_step_and_mlp_only_layers():
    config = {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert dense_layers_from_hf(config, num_experts=8) == [0, 2, 3, 4]
    assert dense_layers_from_hf(config, num_experts=0) == list(range(6))


def _config(**overrides):
    config = dict(
        model_type="mixtral",
        vocab_size=11,
        hidden_size=8,
        intermediate_size=6,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_local_experts=3,
    )
    return {**config, **overrides}


def test_mixtral_keys_map_to_the_hub_names():
    model = TransformerDecoder(args_from_hf(_config()))
    adapter = model.state_dict_adapter
    assert model.args.norm_topk_prob and model.args.num_experts_per_tok == 2
    hf = adapter.to_hf(model.state_dict())
    assert "model.layers.1.block_sparse_moe.gate.weight" in hf
    assert hf["model.layers.0.block_sparse_moe.experts.2.w3.weight"].shape == (6, 8)
    assert torch.equal(
        hf["model.layers.0.block_sparse_moe.experts.2.w3.weight"],
        model.layers[0].mlp.experts.gate_up_proj[2, 6:],
    )
    assert not any(".mlp." in key for key in hf)
    native = adapter.from_hf(hf)
    assert set(native) == set(model.state_dict())
    assert all(torch.equal(native[k], v) for k, v in model.state_dict().items())


def test_unsupported_moe_settings_are_refused():
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        args_from_hf(_config(router_jitter_noise=0.1))
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelArgs(
            vocab_size=4, dim=4, num_layers=1, num_heads=1, num_kv_heads=1,
            intermediate_dim=4, num_experts=2, num_experts_per_tok=3, moe_intermediate_dim=2,
        )  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_hf_config_round_trips(family):
    args = ModelArgs(
        vocab_size=11, dim=8, num_layers=3, num_heads=2, num_kv_heads=1, intermediate_dim=12,
        family=family, qk_norm=family == "qwen3_moe", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_dim=6 if family == "qwen3_moe" else 12,
        norm_topk_prob=True, router_weights_in_fp32=family == "mixtral",
        dense_layers=[1] if family == "qwen3_moe" else [], router_aux_loss_coef=0.01,
        sliding_window=4, layer_types=["sliding_attention"] * 3,
    )  # fmt: skip
    model = TransformerDecoder(args)
    parsed = args_from_hf(model.state_dict_adapter.hf_config(torch.float32))
    assert parsed == args
