"""MoE routing against an independent top-k, per family, and the block against a dense loop.

``tests/unit/test_moe.py`` checks the experts given indices and the router's renormalisation
given its own indices; here the indices and weights themselves are recomputed in fp64 from the
router's parameters with each family's rule as transformers writes it, so a router that picks
the wrong experts (the lowest-scored, say) fails:

- Qwen3-MoE (``Qwen3MoeSparseMoeBlock``): ``softmax(x W^T)``, then the top k, renormalised to
  sum to 1 only with ``norm_topk_prob``;
- Mixtral (``MixtralSparseMoeBlock``): the same, always renormalised;
- gpt-oss (``GptOssTopKRouter``): the top k of the logits ``x W^T + b``, softmaxed over those k.

The block's output is then compared with a dense per-token loop over those independent
experts, each expert's MLP written out from the family's formula.
"""

import pytest
import torch
import torch.nn.functional as F

from tunelab.models import TransformerDecoder, args_from_hf
from tunelab.modules import MoEBlock

NUM_EXPERTS = 6
BASE = dict(
    vocab_size=11,
    hidden_size=8,
    intermediate_size=6,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
)
FAMILIES = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_experts=NUM_EXPERTS, num_experts_per_tok=2,
        moe_intermediate_size=4, norm_topk_prob=False,
    ),
    "qwen3_moe_normalised": dict(
        model_type="qwen3_moe", num_experts=NUM_EXPERTS, num_experts_per_tok=2,
        moe_intermediate_size=4, norm_topk_prob=True,
    ),
    "mixtral": dict(model_type="mixtral", num_local_experts=NUM_EXPERTS, num_experts_per_tok=2),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=NUM_EXPERTS, num_experts_per_tok=3),
}  # fmt: skip


def _block(family: str) -> MoEBlock:
    """The family's MoE block as its HF config builds it, with seeded non-zero parameters."""
    model = TransformerDecoder(args_from_hf({**BASE, **FAMILIES[family]}))
    block = model.layers[0].mlp
    assert isinstance(block, MoEBlock)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in block.parameters():
            # Biases too (gpt-oss's router and experts), so a dropped bias shows.
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return block


def _independent_route(
    family: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_indices, top_weights)`` in fp64 by the family's rule (see the module docstring)."""
    top_k = FAMILIES[family]["num_experts_per_tok"]
    logits = x.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    if family == "gpt_oss":  # top-k of the logits, then a softmax over those k
        top_logits, indices = torch.topk(logits, top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1)
    else:  # softmax over all experts, then top-k (renormalised where the family says so)
        weights, indices = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        if family == "mixtral" or FAMILIES[family].get("norm_topk_prob"):
            weights = weights / weights.sum(-1, keepdim=True)
    # Distinct scores: the fp32 module must find the same experts, so no near-tie at the edge.
    ranked = torch.sort(logits, dim=-1, descending=True).values
    assert (ranked[:, top_k - 1] - ranked[:, top_k]).min() > 1e-3, "test data has a near-tie"
    return indices, weights


def _expert(block: MoEBlock, family: str, expert: int, token: torch.Tensor) -> torch.Tensor:
    """One expert's MLP on one token, fp64, written from the family's formula."""
    experts = block.experts
    gate_up_weight = experts.gate_up_proj[expert].double()
    down_weight = experts.down_proj[expert].double()
    token = token.double()
    if family == "gpt_oss":
        # GptOssExperts: gate_up [D, 2I] with gate and up interleaved, biases, clamped SwiGLU.
        gate_up = token @ gate_up_weight + experts.gate_up_proj_bias[expert].double()
        gate, up = gate_up[::2], gate_up[1::2]
        limit, alpha = experts.swiglu_limit, experts.swiglu_alpha
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        hidden = (up + 1) * gate * torch.sigmoid(gate * alpha)
        return hidden @ down_weight + experts.down_proj_bias[expert].double()
    # Qwen3-MoE / Mixtral: gate_up [2I, D] (gate rows first), down [D, I], SiLU gate.
    gate, up = (gate_up_weight @ token).chunk(2)
    return down_weight @ (F.silu(gate) * up)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_router_picks_the_independent_top_k_with_the_family_weights(family):
    block = _block(family)
    x = torch.randn(32, BASE["hidden_size"], generator=torch.Generator().manual_seed(1))
    indices, weights = _independent_route(family, x, block.gate.weight, block.gate.bias)
    with torch.no_grad():
        probabilities, top_weights, top_indices = block.route(x)
    # The same experts, in the same order (highest first), with the family's weights.
    assert torch.equal(top_indices, indices)
    torch.testing.assert_close(top_weights.double(), weights, rtol=0, atol=1e-6)
    logits = x.double() @ block.gate.weight.double().T
    if block.gate.bias is not None:
        logits = logits + block.gate.bias.double()
    torch.testing.assert_close(probabilities.double(), logits.softmax(-1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_block_equals_a_dense_loop_over_the_independent_experts(family):
    block = _block(family)
    x = torch.randn(2, 16, BASE["hidden_size"], generator=torch.Generator().manual_seed(2))
    flat = x.reshape(-1, x.shape[-1])
    indices, weights = _independent_route(family, flat, block.gate.weight, block.gate.bias)
    expected = torch.zeros(flat.shape, dtype=torch.float64)
    for token in range(flat.shape[0]):
        for slot in range(indices.shape[1]):
            expert = int(indices[token, slot])
            expected[token] += weights[token, slot] * _expert(block, family, expert, flat[token])
    with torch.no_grad():
        ours = block(x)
    assert ours.shape == x.shape
    torch.testing.assert_close(ours.reshape(-1, x.shape[-1]).double(), expected, rtol=0, atol=1e-5)
