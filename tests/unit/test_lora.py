"""LoRALinear math, the generic swap, trainable parameters and disable_adapter."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tunelab.config.lora import LoRAArgs
from tunelab.errors import ConfigError, TunelabError
from tunelab.peft import (
    LoRALinear,
    apply_lora,
    disable_adapter,
    get_adapter_params,
    init_lora_parameters,
    set_trainable_params,
)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(4, 5, bias=False)
        self.v_proj = nn.Linear(4, 1, bias=False)
        self.o_proj = nn.Linear(6, 4, bias=True)

    def forward(self, x):
        return self.o_proj(torch.cat([self.q_proj(x), self.v_proj(x)], dim=-1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(4, 3, bias=False)
        self.up_proj = nn.Linear(4, 3, bias=False)
        self.down_proj = nn.Linear(3, 4, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.self_attn(x)
        return x + self.mlp(x)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(7, 4)
        self.layers = nn.ModuleList([Block(), Block()])


class TinyLM(nn.Module):
    """HF-like names: model.layers.{i}.self_attn.q_proj, ..., lm_head."""

    def __init__(self, tie=False):
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(4, 7, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens):
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(h)


def _fixed_lora(rank, alpha, use_rslora=False, dropout=0.0):
    layer = LoRALinear(2, 2, rank=rank, alpha=alpha, use_rslora=use_rslora, dropout=dropout)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    return layer


def test_lora_linear_hand_checked_rank1():
    # W x = [1*1+2*2, 3*1+4*2] = [5, 11]; A x = 1-2 = -1; B(-1) = [-0.5, -1]; scale 2/1 = 2.
    layer = _fixed_lora(rank=1, alpha=2)
    with torch.no_grad():
        layer.lora_A.weight.copy_(torch.tensor([[1.0, -1.0]]))
        layer.lora_B.weight.copy_(torch.tensor([[0.5], [1.0]]))
    out = layer(torch.tensor([[1.0, 2.0]]))
    assert layer.scale == 2.0
    torch.testing.assert_close(out, torch.tensor([[4.0, 9.0]]), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("use_rslora", "scale", "expected"), [(False, 0.5, [5.5, 12.5]), (True, 1.0, [6.0, 14.0])]
)
def test_lora_linear_scale_and_rslora(use_rslora, scale, expected):
    # rank 4, alpha 2: alpha/r = 0.5, alpha/sqrt(r) = 1. A x = [1, 2, 3, 0]; B A x = [1, 3].
    layer = _fixed_lora(rank=4, alpha=2, use_rslora=use_rslora)
    with torch.no_grad():
        layer.lora_A.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]))
        layer.lora_B.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]))
    assert layer.scale == scale
    out = layer(torch.tensor([[1.0, 2.0]]))
    torch.testing.assert_close(out, torch.tensor([expected]), rtol=0, atol=0)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_the_update_added_in_one_addmm_has_the_formula_s_values_and_gradients(use_rslora):
    # y = x W^T + b + scale * (x A^T) B^T on [batch, seq, in] rows, in fp64: the fused addmm
    # (scale as its alpha) against the formula written out, values and every gradient.
    torch.manual_seed(0)
    layer = LoRALinear(6, 5, rank=3, alpha=5.0, use_rslora=use_rslora, bias=True).double()
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        seen.add(node.name())
        stack.extend(next_fn for next_fn, _ in node.next_functions if next_fn is not None)
    assert "AddmmBackward0" in seen and "MulBackward0" not in seen  # no separate scale pass
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, layer.lora_A.weight, layer.lora_B.weight), grad)
    a, b = (p.detach().clone().requires_grad_() for p in (layer.lora_A.weight, layer.lora_B.weight))
    x_ref = x.detach().clone().requires_grad_()
    expected = F.linear(x_ref, layer.weight, layer.bias) + layer.scale * ((x_ref @ a.T) @ b.T)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    wanted = torch.autograd.grad(expected, (x_ref, a, b), grad)
    for name, value, reference in zip(("x", "A", "B"), got, wanted, strict=True):
        torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12, msg=name)


def test_fresh_lora_is_identity_and_a_is_kaiming_uniform():
    torch.manual_seed(0)
    layer = LoRALinear(16, 8, rank=4, alpha=8, bias=True)
    assert torch.count_nonzero(layer.lora_B.weight) == 0
    bound = 1.0 / math.sqrt(16)  # kaiming_uniform(a=sqrt(5)): gain*sqrt(3/fan_in) = 1/sqrt(fan_in)
    assert 0 < layer.lora_A.weight.abs().max() <= bound
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)


def test_dropout_applies_to_the_adapter_input_only():
    layer = _fixed_lora(rank=1, alpha=1, dropout=0.5)
    with torch.no_grad():
        layer.lora_A.weight.copy_(torch.tensor([[1.0, 1.0]]))
        layer.lora_B.weight.copy_(torch.tensor([[1.0], [1.0]]))
    x = torch.tensor([[1.0, 2.0]] * 64)
    base = F.linear(x, layer.weight)
    layer.train()
    torch.manual_seed(3)
    out = layer(x)
    torch.manual_seed(3)
    dropped = F.dropout(x, 0.5, training=True)
    expected = base + (dropped @ layer.lora_A.weight.T) @ layer.lora_B.weight.T
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not torch.equal(dropped, x)  # the mask did drop something
    layer.eval()
    torch.testing.assert_close(layer(x), base + 3.0, rtol=0, atol=0)  # A x = 3, no dropout


def test_from_linear_reuses_base_parameters_and_freezes_them():
    linear = nn.Linear(4, 3, bias=True)
    layer = LoRALinear.from_linear(linear, rank=2, alpha=4)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert not layer.weight.requires_grad and not layer.bias.requires_grad
    assert layer.scale == 2.0
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), linear(x), rtol=0, atol=0)
    assert set(layer.state_dict()) == {"weight", "bias", "lora_A.weight", "lora_B.weight"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0, "alpha": 1}, "rank"),
        ({"rank": 2, "alpha": 0}, "alpha"),
        ({"rank": 2, "alpha": 1, "dropout": 1.0}, "dropout"),
    ],
)
def test_bad_lora_options_raise_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LoRALinear(2, 2, **kwargs)


def test_apply_lora_swaps_targets_and_trains_only_adapters():
    model = TinyLM()
    swapped = apply_lora(model, LoRAArgs(targets=["q_proj", "v_proj", "lm_head"], rank=2, alpha=4))
    assert swapped == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
        "lm_head",
    ]
    assert isinstance(model.lm_head, LoRALinear)
    assert isinstance(model.model.layers[0].self_attn.o_proj, nn.Linear)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert (
        trainable
        == set(get_adapter_params(model))
        == {f"{s}.lora_{ab}.weight" for s in swapped for ab in "AB"}
    )
    # The base keys are unchanged by the swap.
    assert "model.layers.0.self_attn.q_proj.weight" in model.state_dict()


def test_all_linear_excludes_lm_head():
    model = TinyLM()
    swapped = apply_lora(model, LoRAArgs(targets="all-linear", rank=2, alpha=4))
    assert len(swapped) == 12 and "lm_head" not in swapped
    assert not isinstance(model.lm_head, LoRALinear)


def test_apply_lora_errors():
    with pytest.raises(
        TunelabError, match=r"'qproj' matches no nn.Linear.*down_proj, gate_proj, lm_head, o_proj"
    ):
        apply_lora(TinyLM(), LoRAArgs(targets=["q_proj", "qproj"], rank=2, alpha=4))
    with pytest.raises(TunelabError, match="targets is empty"):
        apply_lora(TinyLM(), LoRAArgs(targets=[], rank=2, alpha=4))
    model = TinyLM()
    apply_lora(model, LoRAArgs(targets=["q_proj"], rank=2, alpha=4))
    with pytest.raises(TunelabError, match="already has LoRA"):
        apply_lora(model, LoRAArgs(targets=["v_proj"], rank=2, alpha=4))
    with pytest.raises(TunelabError, match="no LoRA layers"):
        set_trainable_params(TinyLM())


def test_tied_lm_head_stays_tied():
    model = TinyLM(tie=True)
    apply_lora(model, LoRAArgs(targets=["lm_head"], rank=2, alpha=4))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _randomise_b(model):
    with torch.no_grad():
        for param in get_adapter_params(model).values():
            param.normal_()


def test_disable_adapter_gives_base_output_and_restores_even_on_error():
    torch.manual_seed(0)
    base = TinyLM()
    model = TinyLM()
    model.load_state_dict(base.state_dict())
    apply_lora(model, LoRAArgs(targets="all-linear", rank=2, alpha=4))
    _randomise_b(model)
    tokens = torch.tensor([[1, 2, 3, 4]])
    with_adapter = model(tokens)
    assert not torch.allclose(with_adapter, base(tokens))
    with disable_adapter(model):
        torch.testing.assert_close(model(tokens), base(tokens), rtol=0, atol=0)
    torch.testing.assert_close(model(tokens), with_adapter, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="boom"), disable_adapter(model):
        raise RuntimeError("boom")
    torch.testing.assert_close(model(tokens), with_adapter, rtol=0, atol=0)


def test_meta_build_then_materialise_and_init():
    torch.manual_seed(0)
    reference = TinyLM()
    with torch.device("meta"):
        model = TinyLM()
        apply_lora(model, LoRAArgs(targets=["q_proj", "down_proj"], rank=3, alpha=6))
    assert model.model.layers[0].self_attn.q_proj.lora_A.weight.is_meta
    model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    assert not unexpected and all(".lora_" in key for key in missing)
    torch.manual_seed(7)
    init_lora_parameters(model)
    torch.manual_seed(7)
    expected_a = nn.init.kaiming_uniform_(torch.empty(3, 4), a=math.sqrt(5))
    torch.testing.assert_close(
        model.model.layers[0].self_attn.q_proj.lora_A.weight, expected_a, rtol=0, atol=0
    )
    assert torch.count_nonzero(model.model.layers[1].mlp.down_proj.lora_B.weight) == 0
    tokens = torch.tensor([[0, 6, 2]])
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)
