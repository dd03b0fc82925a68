"""LoRA's update ``out + scale * B(low)``: addmm's gradients, bit for bit, from a faster layout.

``LoRALinear._add_update`` runs ``_AddUpdate``, whose backward computes ``B``'s gradient from a
contiguous copy of ``g^T`` instead of autograd's transposed view (about 2x faster at GRPO's
update shapes on AVX2). These tests hold it to autograd's ``addmm`` bit for bit, at the tiny
and the bench's wide shapes, and check that the view is really gone from the fp32 backward.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tunelab.peft.lora import LoRALinear, _AddUpdate

# (tokens, in_dim, out_dim, rank, scale): the bench's wide-16 update on one of 2 processes
# (832 tokens: 4 prompts of 16 + 16 completions of 48) and on one (1664), its down and k/v
# projections, the tiny model's, odd sizes, a single token, scale 1 (no multiply).
SHAPES = [
    (832, 768, 2048, 8, 2.0),
    (1664, 768, 2048, 8, 2.0),
    (832, 2048, 768, 8, 2.0),
    (832, 768, 256, 8, 2.0),
    (37, 128, 384, 8, 2.0),
    (5, 64, 64, 4, 0.5),
    (1, 128, 256, 16, 1.0),
    (300, 256, 1024, 16, 1.7),
]


def _grads(update, shape, dtype=torch.float32):
    tokens, in_dim, out_dim, rank, scale = shape
    generator = torch.Generator().manual_seed(tokens + out_dim)

    def draw(*size, grad=False):
        return (torch.randn(*size, generator=generator) * 0.05).to(dtype).requires_grad_(grad)

    x = draw(tokens, in_dim, grad=True)
    weight, upstream = draw(out_dim, in_dim), draw(tokens, out_dim)
    lora_a, lora_b = draw(rank, in_dim, grad=True), draw(out_dim, rank, grad=True)
    out = x @ weight.t()
    y = update(out, x @ lora_a.t(), lora_b, scale)
    (y * upstream).sum().backward()
    return [y.detach(), x.grad, lora_a.grad, lora_b.grad]


def _autograd_addmm(out, low, lora_b, scale):
    return torch.addmm(out, low, lora_b.t(), alpha=scale)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_update_has_addmms_output_and_gradients_bit_for_bit(shape):
    expected = _grads(_autograd_addmm, shape)
    got = _grads(_AddUpdate.apply, shape)
    for name, want, have in zip(("output", "x", "A", "B"), expected, got, strict=True):
        assert torch.equal(have, want), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_autograds_layout_and_its_bits(dtype):
    # In bf16/fp16 the contiguous copy rounds differently (measured), so the view stays.
    shape = (832, 768, 2048, 8, 2.0)
    for want, have in zip(
        _grads(_autograd_addmm, shape, dtype), _grads(_AddUpdate.apply, shape, dtype)
    ):
        assert torch.equal(have, want)


class _MatmulLayouts(TorchDispatchMode):
    """Records the first operand's strides of every ``mm``."""

    def __init__(self):
        super().__init__()
        self.first_strides = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.first_strides.append((tuple(args[0].shape), args[0].stride()))
        return func(*args, **(kwargs or {}))


def test_a_lora_layers_backward_multiplies_no_transposed_gradient_view():
    # The change itself: without it, B's gradient multiplies g^T as a view (strides (1, out)).
    torch.manual_seed(0)
    layer = LoRALinear(768, 2048, rank=8, alpha=16.0)
    torch.nn.init.normal_(layer.lora_B.weight, std=0.02)
    x = torch.randn(4, 208, 768)  # 832 tokens
    out = layer(x)
    layouts = _MatmulLayouts()
    upstream = torch.randn(out.shape)  # a real gradient (sum()'s is a broadcast, strides 0)
    with layouts:
        out.backward(upstream)
    # B's gradient: the [out_dim, tokens] operand (A's own, [rank, tokens], is nn.Linear's).
    gradient_views = [
        stride for shape, stride in layouts.first_strides if shape == (2048, 832) and stride[0] == 1
    ]
    assert layouts.first_strides and not gradient_views, layouts.first_strides
    assert layer.lora_B.weight.grad is not None and layer.lora_A.weight.grad is not None
    # And the module's gradients are autograd's addmm's.
    reference = LoRALinear(768, 2048, rank=8, alpha=16.0)
    reference.load_state_dict(layer.state_dict())
    low = reference.lora_A(x).reshape(-1, 8)
    base = torch.nn.functional.linear(x, reference.weight).reshape(-1, 2048)
    expected = _autograd_addmm(base, low, reference.lora_B.weight, reference.scale)
    expected.backward(upstream.reshape(-1, 2048))
    assert torch.equal(out.reshape(-1, 2048), expected)
    assert torch.equal(layer.lora_B.weight.grad, reference.lora_B.weight.grad)
    assert torch.equal(layer.lora_A.weight.grad, reference.lora_A.weight.grad)
