"""QLoRA on stacked MoE expert weights: NF4 experts packed 2-D ``[E * rows, cols]``.

The codes equal torchao's ``to_nf4`` of the same weight bit for bit (both layouts); LoRA on NF4
experts gives the forward and the gradients of an fp64 reference on the dequantized weights
(an expert with no token included), and only the packed weight is saved for the backward; the
merge equals torchao-dequantize-then-merge; experts that cannot be packed stay plain, with the
reason. Under FSDP2 on 2 processes: tests/unit/test_expert_nf4_fsdp.py.
"""

import pytest
import torch

from tests.unit.test_expert_lora import NUM_EXPERTS, RANK, TOP_K, _factor, _reference
from tunelab.config.lora import EXPERT_TARGETS, LoRAArgs
from tunelab.models import ModelArgs, TransformerDecoder
from tunelab.modules import MoEExperts
from tunelab.peft import ExpertLoRA, apply_lora, get_adapter_params, merged_state_dict

pytest.importorskip("torchao")
from torchao.quantization import to_nf4  # noqa: E402

from tunelab.peft.nf4 import (  # noqa: E402
    copy_rows_nf4_,
    dequantize_experts,
    is_nf4,
    quantize_base_nf4,
)

# Each stacked weight holds whole blocks of 64 x 256 values per expert pair: NF4 on 1 or 2
# processes (5 experts: NUM_EXPERTS of test_expert_lora, so 1 process only).
DIM, HIDDEN = 64, 256


class _Holder(torch.nn.Module):
    def __init__(self, experts: MoEExperts) -> None:
        super().__init__()
        self.experts = experts


def _plain_experts(layout: str) -> MoEExperts:
    torch.manual_seed(0)
    experts = MoEExperts(DIM, HIDDEN, NUM_EXPERTS, layout=layout, bias=layout == "gpt_oss")
    with torch.no_grad():
        for name, param in experts.named_parameters():
            if name.endswith("bias"):
                param.normal_()
            else:
                param.normal_(std=0.2)
    return experts


def _nf4_experts(layout: str, projections=("gate_up_proj", "down_proj")):
    """``(nf4, plain)``: the same experts, one NF4-packed the recipe's way, with equal adapters."""
    plain = _plain_experts(layout)
    with torch.device("meta"):
        experts = MoEExperts(DIM, HIDDEN, NUM_EXPERTS, layout=layout, bias=layout == "gpt_oss")
    experts.requires_grad_(False)  # the frozen base, as apply_lora leaves it
    _adapters(experts, projections)
    holder = _Holder(experts)
    plan = quantize_base_nf4(holder, device=torch.device("cpu"))
    assert plan.quantized == ["experts.gate_up_proj", "experts.down_proj"] and not plan.kept
    holder.to_empty(device="cpu")
    for name, param in plain.named_parameters():
        copy_rows_nf4_(experts.get_parameter(name), param.detach())
    _adapters(plain, projections)
    torch.manual_seed(1)
    for name in projections:
        for factor in ("lora_A", "lora_B"):
            values = torch.randn_like(getattr(plain.lora[name], factor).weight) * 0.3
            for holder_experts in (experts, plain):
                weight = getattr(holder_experts.lora[name], factor).weight
                with torch.no_grad():
                    weight.copy_(values)
    return experts, plain


def _adapters(experts: MoEExperts, projections) -> None:
    for name in projections:
        weight = getattr(experts, name)
        in_dim, out_dim = weight.shape[1:] if experts.transposed else weight.shape[:0:-1]
        experts.lora[name] = ExpertLoRA(
            NUM_EXPERTS, in_dim, out_dim, rank=RANK, alpha=6.0, transposed=experts.transposed,
            device=weight.device,
        )  # fmt: skip


@pytest.mark.parametrize("layout", ["stacked", "gpt_oss"])
def test_codes_equal_torchao_on_the_same_weight(layout):
    experts, plain = _nf4_experts(layout)
    for name in ("gate_up_proj", "down_proj"):
        weight, packed = getattr(plain, name).detach(), getattr(experts, name)
        assert is_nf4(packed) and packed.shape == (NUM_EXPERTS * weight.shape[1], weight.shape[2])
        reference = to_nf4(weight.reshape(packed.shape), 64, 256)
        for inner in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
            assert torch.equal(getattr(packed, inner), getattr(reference, inner)), (name, inner)
        values = dequantize_experts(packed, NUM_EXPERTS)
        assert values.shape == weight.shape  # gpt-oss keeps [E, in, out]
        assert torch.equal(values, reference.get_original_weight().view(weight.shape))
        # What the forward and backward unpack: the same values.
        assert torch.equal(experts.unpack_weight(packed), reference.get_original_weight())
        error = float((values - weight).abs().max())
        assert 0 < error < 0.2 * float(weight.abs().max())  # rounded, not the weight


def _dequantized_twin(experts: MoEExperts, plain: MoEExperts) -> MoEExperts:
    """``plain`` with the NF4 experts' dequantized weights, in fp64, sharing no tensor."""
    twin = _plain_experts("gpt_oss" if plain.transposed else "stacked")
    _adapters(twin, list(plain.lora))
    twin.load_state_dict(plain.state_dict())
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            getattr(twin, name).copy_(dequantize_experts(getattr(experts, name), NUM_EXPERTS))
    return twin.double()


def _routing(num_tokens: int = 13):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, DIM, generator=generator)
    scores = torch.randn(num_tokens, NUM_EXPERTS, generator=generator)
    scores[:, 1] = -10  # expert 1 gets no token: an empty group
    top_weights, top_indices = scores.softmax(-1).topk(TOP_K, dim=-1)
    assert not (top_indices == 1).any()
    return x, top_weights, top_indices


@pytest.mark.parametrize("grouped", [None, False], ids=["grouped_mm", "padded_bmm"])
@pytest.mark.parametrize(
    ("layout", "projections"),
    [("stacked", ("gate_up_proj", "down_proj")), ("gpt_oss", ("gate_up_proj", "down_proj")),
     ("stacked", ("down_proj",))],
)  # fmt: skip
def test_forward_and_gradients_equal_an_fp64_reference_on_the_dequantized_weights(
    layout, projections, grouped
):
    experts, plain = _nf4_experts(layout, projections)
    experts.swiglu_limit = None  # the reference gates with silu
    experts.grouped = grouped
    twin = _dequantized_twin(experts, plain)
    x, top_weights, top_indices = _routing()
    x_ours, x_reference = x.clone().requires_grad_(), x.double().requires_grad_()
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        ours = experts(x_ours, top_weights, top_indices)
    # Only the packed NF4 weights are kept for the backward, never their dequantized values.
    full = [t for t in saved if not is_nf4(t) and t.numel() >= NUM_EXPERTS * DIM * HIDDEN]
    assert not full, [tuple(t.shape) for t in full]
    assert sum(is_nf4(t) for t in saved) == 2
    reference = _reference(twin, x_reference, top_weights.double(), top_indices)
    # fp32 against fp64: within a few fp32 roundings of the output's scale.
    scale = float(reference.detach().abs().max())
    torch.testing.assert_close(ours.double(), reference, rtol=0, atol=1e-6 * scale)
    ours.square().sum().backward()
    reference.square().sum().backward()
    scale = float(x_reference.grad.abs().max())
    torch.testing.assert_close(x_ours.grad.double(), x_reference.grad, rtol=0, atol=1e-6 * scale)
    for name in projections:
        for factor in ("lora_A", "lora_B"):
            grad = getattr(experts.lora[name], factor).weight.grad
            expected = getattr(twin.lora[name], factor).weight.grad
            scale = float(expected.abs().max())
            torch.testing.assert_close(grad.double(), expected, rtol=0, atol=1e-6 * scale)
            # Expert 1 had no token: its factors get no gradient; the others do.
            assert float(_factor(grad, 1, factor[-1]).abs().max()) == 0
            assert float(_factor(grad, 0, factor[-1]).abs().max()) > 0
    assert experts.gate_up_proj.grad is None and experts.down_proj.grad is None


def _tiny_moe_args(layout: str, num_experts: int = 4) -> ModelArgs:
    return ModelArgs(
        vocab_size=64, dim=DIM, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_dim=24,
        num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_dim=HIDDEN,
        expert_layout=layout, expert_bias=layout == "gpt_oss",
    )  # fmt: skip


def nf4_moe_model(args: ModelArgs, state: dict, lora: LoRAArgs, world_size: int = 1):
    """The recipe's order on one process: meta, LoRA, NF4, materialise, load the rows."""
    with torch.device("meta"):
        model = TransformerDecoder(args)
    apply_lora(model, lora)
    plan = quantize_base_nf4(model, device=torch.device("cpu"), world_size=world_size)
    model.to_empty(device="cpu")
    for key, param in model.state_dict(keep_vars=True).items():
        if key in state:
            copy_rows_nf4_(param, state[key])
    return model, plan


@pytest.mark.parametrize("layout", ["stacked", "gpt_oss"])
def test_merge_equals_torchao_dequantize_then_merge(layout):
    """Only gate_up_proj adapted: down_proj's merge is its dequantized values alone."""
    args = _tiny_moe_args(layout)
    torch.manual_seed(0)
    source = TransformerDecoder(args)
    with torch.no_grad():
        for name, param in source.named_parameters():
            if "experts" in name:
                param.normal_(std=0.2 if name.endswith("proj") else 1.0)
    state = source.state_dict()
    lora = LoRAArgs(rank=2, alpha=4.0, targets=["q_proj", "experts.gate_up_proj"])
    model, plan = nf4_moe_model(args, state, lora)
    assert {f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj",
            "down_proj")} <= set(plan.quantized)  # fmt: skip
    torch.manual_seed(1)
    with torch.no_grad():
        for param in get_adapter_params(model).values():
            param.normal_(std=0.3)
    merged = merged_state_dict(model)
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.mlp.experts."
        adapter = model.layers[layer].mlp.experts.lora["gate_up_proj"]
        for name in ("gate_up_proj", "down_proj"):
            weight = state[prefix + name]
            values = to_nf4(weight.reshape(-1, weight.shape[-1])).get_original_weight()
            expected = values.view(weight.shape).double()
            if name == "gate_up_proj":
                a, b = adapter.lora_A.weight.double(), adapter.lora_B.weight.double()
                # Expert e: A rows e*r .. e*r+r-1, B columns k*E + e (PEFT's layout).
                delta = torch.stack(
                    [adapter.scale * b[:, e::4] @ a[e * 2 : (e + 1) * 2] for e in range(4)]
                )
                expected = expected + (delta.transpose(1, 2) if layout == "gpt_oss" else delta)
            assert merged[prefix + name].shape == weight.shape
            torch.testing.assert_close(merged[prefix + name].double(), expected, rtol=0, atol=1e-6)
    # The merged model runs as the NF4 model with its adapters.
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = TransformerDecoder(args)
        plain.load_state_dict(merged)
        torch.testing.assert_close(plain(tokens), model(tokens), rtol=0, atol=1e-4)


def test_experts_that_cannot_be_packed_stay_plain_with_the_reason():
    lora = LoRAArgs(rank=2, alpha=4.0, targets=["q_proj", *EXPERT_TARGETS])
    with torch.device("meta"):
        model = TransformerDecoder(_tiny_moe_args("stacked", num_experts=5))
    apply_lora(model, lora)
    plan = quantize_base_nf4(model, device=torch.device("cpu"), world_size=2)
    reason = plan.kept["model.layers.0.mlp.experts.down_proj"]
    assert reason == "5 experts do not split evenly over 2 processes"
    assert model.layers[0].mlp.experts.down_proj.dim() == 3
    assert model.layers[0].mlp.experts.unpack_weight is None


def test_activation_checkpointing_gives_the_same_gradients():
    """The Mixtral QLoRA config recomputes each block: the unpack runs again, same bits."""
    from tunelab.distributed import apply_activation_checkpointing

    args = _tiny_moe_args("stacked")
    torch.manual_seed(0)
    state = TransformerDecoder(args).state_dict()
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointed in (False, True):
        lora = LoRAArgs(rank=2, alpha=4.0, targets=["q_proj", *EXPERT_TARGETS])
        model, _ = nf4_moe_model(args, state, lora)
        torch.manual_seed(1)
        with torch.no_grad():
            for param in get_adapter_params(model).values():
                param.normal_(std=0.3)
        if checkpointed:
            apply_activation_checkpointing(model)
        model(tokens).square().mean().backward()
        grads.append({k: p.grad for k, p in get_adapter_params(model).items()})
    assert len(grads[0]) == 12 and all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_nf4_weights_have_a_compile_cache_key_of_their_layout_not_their_values():
    """``compile: true``: torch's AOT autograd cache names an NF4 input by its layout (shape,
    strides, block sizes, packed tensors' shapes), never its values (weights are inputs)."""
    from tunelab.peft.nf4 import _torchao_nf4

    nf4_tensor, _ = _torchao_nf4()  # installs the method once
    generator = torch.Generator().manual_seed(0)
    one, other = (to_nf4(torch.randn(128, 256, generator=generator)) for _ in range(2))
    wider = to_nf4(torch.randn(128, 512, generator=generator))
    assert isinstance(one, nf4_tensor)
    assert one._stable_hash_for_caching() == other._stable_hash_for_caching()
    assert one._stable_hash_for_caching() != wider._stable_hash_for_caching()
    assert to_nf4(torch.randn(128, 256), block_size=32)._stable_hash_for_caching() != (
        one._stable_hash_for_caching()
    )
