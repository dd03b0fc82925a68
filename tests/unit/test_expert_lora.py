"""LoRA on stacked MoE expert weights: the grouped update against a per-expert reference,
the merge, PEFT's key names, the round trip through our adapter loader, and bad settings."""

import pytest
import torch
import torch.nn.functional as F

from tunelab.cli._check import check_config
from tunelab.config.lora import EXPERT_TARGETS, LoRAArgs
from tunelab.errors import ConfigError, TunelabError
from tunelab.models import ModelArgs, TransformerDecoder
from tunelab.modules import MoEExperts
from tunelab.peft import (
    ExpertLoRA,
    adapter_state_dict,
    apply_lora,
    disable_adapter,
    get_adapter_params,
    load_peft_adapter,
    lora_target_names,
    merged_state_dict,
    save_peft_adapter,
)
from tunelab.peft.state import to_peft_state_dict

NUM_EXPERTS, DIM, HIDDEN, RANK, TOP_K = 5, 8, 12, 4, 2


def _experts(layout: str, dtype: torch.dtype) -> MoEExperts:
    torch.manual_seed(0)
    experts = MoEExperts(DIM, HIDDEN, NUM_EXPERTS, layout=layout, bias=layout == "gpt_oss")
    if experts.gate_up_proj_bias is not None:
        torch.nn.init.normal_(experts.gate_up_proj_bias)
        torch.nn.init.normal_(experts.down_proj_bias)
    return experts.to(dtype)


def _factor(stored: torch.Tensor, expert: int, which: str) -> torch.Tensor:
    """Expert ``expert``'s ``A`` ``[r, in]`` or ``B`` ``[out, r]`` read off PEFT's layout by
    index: ``A`` rows ``e*r .. e*r+r-1``, ``B`` columns ``k*E + e``."""
    if which == "A":
        return stored[expert * RANK : (expert + 1) * RANK]
    return stored[:, [k * NUM_EXPERTS + expert for k in range(RANK)]]


def _reference(experts: MoEExperts, x, top_weights, top_indices) -> torch.Tensor:
    """Token by token, expert by expert, with ``W_e + scale * B_e A_e`` formed explicitly."""
    matrices = {}
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, name).detach().double()
        if experts.transposed:
            weight = weight.transpose(1, 2)  # [E, out, in]
        if name in experts.lora:
            adapter = experts.lora[name]
            a, b = (adapter.lora_A.weight.double(), adapter.lora_B.weight.double())
            weight = torch.stack(
                [
                    weight[e] + adapter.scale * _factor(b, e, "B") @ _factor(a, e, "A")
                    for e in range(NUM_EXPERTS)
                ]
            )
        matrices[name] = weight
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for token in range(x.shape[0]):
        for slot in range(TOP_K):
            e = int(top_indices[token, slot])
            gate_up = matrices["gate_up_proj"][e] @ x[token].double()
            if experts.gate_up_proj_bias is not None:
                gate_up = gate_up + experts.gate_up_proj_bias[e].double()
            gate, up = (gate_up[::2], gate_up[1::2]) if experts.transposed else gate_up.chunk(2)
            hidden = F.silu(gate) * up
            y = matrices["down_proj"][e] @ hidden
            if experts.down_proj_bias is not None:
                y = y + experts.down_proj_bias[e].double()
            out[token] += top_weights[token, slot].double() * y
    return out


def _adapt(experts: MoEExperts, projections) -> None:
    for name in projections:
        weight = getattr(experts, name)
        in_dim, out_dim = weight.shape[1:] if experts.transposed else weight.shape[:0:-1]
        experts.lora[name] = ExpertLoRA(
            NUM_EXPERTS,
            in_dim,
            out_dim,
            rank=RANK,
            alpha=6.0,
            transposed=experts.transposed,
            dtype=weight.dtype,
        )
        torch.nn.init.normal_(experts.lora[name].lora_B.weight, std=0.5)


def _routing(num_tokens: int = 11):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, DIM, generator=generator)
    scores = torch.randn(num_tokens, NUM_EXPERTS, generator=generator)
    scores[:, 1] = -10  # expert 1 gets no token: an empty group
    top_weights, top_indices = scores.softmax(-1).topk(TOP_K, dim=-1)
    return x, top_weights, top_indices


@pytest.mark.parametrize("projections", [("gate_up_proj", "down_proj"), ("down_proj",)])
@pytest.mark.parametrize("layout", ["stacked", "gpt_oss"])
@pytest.mark.parametrize("grouped", [None, False], ids=["grouped_mm", "padded_bmm"])
def test_grouped_update_equals_a_per_expert_reference(layout, projections, grouped):
    x, top_weights, top_indices = _routing()
    experts = _experts(layout, torch.float32)
    experts.swiglu_limit = None  # the reference gates with silu
    _adapt(experts, projections)
    experts.grouped = grouped
    with torch.no_grad():
        ours = experts(x, top_weights, top_indices)
        reference = _reference(experts, x, top_weights, top_indices)
        for adapter in experts.lora.values():
            adapter.disabled = True
        base = experts(x, top_weights, top_indices)
    torch.testing.assert_close(ours.double(), reference, rtol=0, atol=2e-5)
    assert float((base - ours).abs().max()) > 1e-2  # the update is not negligible


def test_gradients_reach_only_the_factors_and_equal_the_reference():
    x, top_weights, top_indices = _routing()
    experts = _experts("stacked", torch.float64)
    _adapt(experts, ("gate_up_proj", "down_proj"))
    experts.grouped = False
    for name, param in experts.named_parameters():
        param.requires_grad_("lora" in name)
    experts(x.double(), top_weights.double(), top_indices).square().sum().backward()
    ours = {name: p.grad.clone() for name, p in experts.named_parameters() if p.requires_grad}
    for param in experts.parameters():
        param.grad = None
    _reference(experts, x, top_weights, top_indices).square().sum().backward()
    assert len(ours) == 4
    for name, param in experts.named_parameters():
        if name in ours:
            torch.testing.assert_close(ours[name], param.grad, rtol=1e-9, atol=1e-9)
            assert float(param.grad.abs().max()) > 0
        else:
            assert param.grad is None


def _tiny_moe_model(layout: str = "stacked") -> TransformerDecoder:
    args = ModelArgs(
        vocab_size=64,
        dim=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_dim=24,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_dim=8,
        expert_layout=layout,
    )
    torch.manual_seed(0)
    return TransformerDecoder(args)


@pytest.mark.parametrize("layout", ["stacked", "gpt_oss"])
def test_merge_equals_the_adapted_forward(layout):
    model = _tiny_moe_model(layout)
    swapped = apply_lora(model, LoRAArgs(rank=2, alpha=4.0, targets=["o_proj", *EXPERT_TARGETS]))
    assert swapped[:3] == [
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    ]
    with torch.no_grad():
        for name, param in get_adapter_params(model).items():
            if "lora_B" in name:
                param.normal_(std=0.3)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(tokens)
        merged = merged_state_dict(model)
        assert not any("lora" in key for key in merged)
        plain = _tiny_moe_model(layout)
        plain.load_state_dict(merged)
        torch.testing.assert_close(plain(tokens), adapted, rtol=0, atol=1e-5)
        with disable_adapter(model):
            assert float((model(tokens) - adapted).abs().max()) > 1e-2
    # Out of place: the live expert weights are still the base's.
    base = _tiny_moe_model(layout).layers[0].mlp.experts.down_proj
    assert torch.equal(model.layers[0].mlp.experts.down_proj, base)
    assert not torch.equal(plain.layers[0].mlp.experts.down_proj, base)


def test_peft_key_names_and_our_loader_round_trip(tmp_path):
    model = _tiny_moe_model()
    lora = LoRAArgs(rank=2, alpha=4.0, targets=["q_proj", *EXPERT_TARGETS])
    swapped = apply_lora(model, lora)
    assert lora_target_names(model) == ["experts.down_proj", "experts.gate_up_proj", "q_proj"]
    config = lora.peft_config(swapped, None)
    assert config["target_modules"] == ["q_proj"]
    assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    assert LoRAArgs.from_peft_config(config).targets == ["q_proj", *sorted(EXPERT_TARGETS)]
    with torch.no_grad():
        for param in get_adapter_params(model).values():
            param.normal_()
    state = adapter_state_dict(model)
    peft_keys = set(to_peft_state_dict(state))
    prefix = "base_model.model.model.layers.0.mlp.experts."
    # PEFT wraps gate_up_proj first (parameter order), so down_proj's wrapper is outermost.
    assert {k for k in peft_keys if k.startswith(prefix)} == {
        prefix + "base_layer.lora_A.weight",
        prefix + "base_layer.lora_B.weight",
        prefix + "lora_A.weight",
        prefix + "lora_B.weight",
    }
    native = "model.layers.0.mlp.experts.lora."
    renamed = to_peft_state_dict(state)
    assert renamed[prefix + "lora_A.weight"] is state[native + "down_proj.lora_A.weight"]
    assert (
        renamed[prefix + "base_layer.lora_B.weight"] is state[native + "gate_up_proj.lora_B.weight"]
    )
    assert state[native + "down_proj.lora_A.weight"].shape == (4 * 2, 8)  # [E * r, in]
    assert state[native + "gate_up_proj.lora_B.weight"].shape == (2 * 8, 2 * 4)  # [out, r * E]
    save_peft_adapter(state, config, tmp_path / "adapter")
    fresh = _tiny_moe_model()
    apply_lora(fresh, LoRAArgs.from_peft_config(config))
    load_peft_adapter(fresh, tmp_path / "adapter")
    loaded = adapter_state_dict(fresh)
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[key], state[key]) for key in state)


def test_bad_expert_settings_are_one_clear_error():
    with pytest.raises(ConfigError, match="key 'lora.dropout'"):
        apply_lora(_tiny_moe_model(), LoRAArgs(dropout=0.1, targets=["experts.down_proj"]))
    with pytest.raises(ConfigError, match="key 'lora.use_dora'"):
        apply_lora(_tiny_moe_model(), LoRAArgs(use_dora=True, targets=["experts.down_proj"]))
    # A bare down_proj means dense MLP linears; this model has none, and the message says how
    # to name the experts.
    with pytest.raises(TunelabError, match="experts.gate_up_proj / experts.down_proj"):
        apply_lora(_tiny_moe_model(), LoRAArgs(targets=["down_proj"]))
    # Attention-only targets may still use dropout.
    apply_lora(_tiny_moe_model(), LoRAArgs(dropout=0.1, targets=["q_proj"]))


def test_tunelab_validate_names_the_key_before_any_model_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    targets = "lora.targets=[q_proj,experts.down_proj]"
    check_config("tiny/moe_lora", [targets])
    with pytest.raises(ConfigError, match="key 'lora.dropout'"):
        check_config("tiny/moe_lora", [targets, "lora.dropout=0.05"])
    with pytest.raises(ConfigError, match="key 'lora.use_dora'"):
        check_config("tiny/moe_lora", [targets, "lora.use_dora=true"])


def test_with_an_nf4_base_small_experts_stay_plain_and_merge_matches_the_forward():
    """QLoRA plus expert LoRA on experts too small for NF4's blocks: the attention weights go to
    NF4, the stacked experts (listed as kept, with the reason) and their factors stay in the
    training dtype, and the merge (NF4 dequantized) equals the forward. Experts large enough
    for NF4: tests/unit/test_expert_nf4.py."""
    pytest.importorskip("torchao")
    from tunelab.peft.nf4 import copy_rows_nf4_, is_nf4, quantize_base_nf4

    args = ModelArgs(
        vocab_size=64, dim=128, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_dim=24,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    state = TransformerDecoder(args).state_dict()
    with torch.device("meta"):
        model = TransformerDecoder(args)
    apply_lora(model, LoRAArgs(rank=2, alpha=4.0, targets=["q_proj", *EXPERT_TARGETS]))
    plan = quantize_base_nf4(model, device=torch.device("cpu"))
    assert "model.layers.0.self_attn.q_proj" in plan.quantized
    assert not any("experts" in name for name in plan.quantized)
    assert "64 x 256" in plan.kept["model.layers.0.mlp.experts.down_proj"]  # 4 x 128 x 8 values
    model.to_empty(device="cpu")
    for key, param in model.state_dict(keep_vars=True).items():
        if key in state:
            copy_rows_nf4_(param, state[key])
    torch.manual_seed(1)
    with torch.no_grad():
        for param in get_adapter_params(model).values():
            param.normal_(std=0.3)
    experts = model.layers[0].mlp.experts
    assert is_nf4(model.layers[0].self_attn.q_proj.weight) and not is_nf4(experts.down_proj)
    assert experts.lora["down_proj"].lora_A.weight.requires_grad
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(tokens)
        plain = TransformerDecoder(args)
        plain.load_state_dict(merged_state_dict(model))
        torch.testing.assert_close(plain(tokens), adapted, rtol=0, atol=1e-4)
        with disable_adapter(model):
            assert float((model(tokens) - adapted).abs().max()) > 1e-2
