"""Linear weights packed for oneDNN (the rollout's decode matmuls on CPU): the values of
``F.linear`` up to rounding, rows whose bits do not depend on the batch, and a model left as it
was after the block."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tunelab.config.lora import LoRAArgs
from tunelab.models.args import ModelArgs
from tunelab.models.decoder import TransformerDecoder
from tunelab.modules import packed_linear
from tunelab.modules.packed_linear import linear, pack_weight, packable, packed_linears
from tunelab.peft import LoRALinear, apply_lora, merged_adapters

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


@pytest.mark.parametrize(("out_dim", "in_dim"), [(96, 64), (64, 160)])
def test_a_packed_weight_gives_f_linear_and_each_row_its_bits_in_any_batch(out_dim, in_dim):
    torch.manual_seed(0)
    weight, bias = torch.randn(out_dim, in_dim), torch.randn(out_dim)
    x = torch.randn(3, 11, in_dim)
    packed = pack_weight(weight, 32)
    assert packed.is_mkldnn and not packable(packed)
    out = linear(x, packed, bias)
    assert out.shape == (3, 11, out_dim)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=0, atol=2e-5)
    rows = x.reshape(33, in_dim)
    whole = linear(rows, packed, None)
    # The rollout engine prefills a prompt once for its group and drops finished rows: a row's
    # values must not depend on how many rows share the matmul (2 or more; MKL's own sgemm
    # differs for a single row too).
    for count in (2, 3, 5, 16, 17, 32):
        assert torch.equal(linear(rows[:count], packed, None), whole[:count]), count
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))  # plain: F.linear


def test_only_plain_fp32_cpu_matrices_are_packable():
    assert packable(nn.Parameter(torch.zeros(4, 3)))
    assert not packable(None)
    assert not packable(torch.zeros(4, 3, dtype=torch.bfloat16))
    assert not packable(torch.zeros(2, 4, 3))


def lora_model() -> TransformerDecoder:
    """A random decoder with LoRA on q and v only: the other projections and lm_head stay
    plain ``nn.Linear``."""
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_dim=48, head_dim=8, max_seq_len=64,
    )  # fmt: skip
    model = TransformerDecoder(args)
    for param in model.parameters():
        nn.init.normal_(param, std=0.2)
    apply_lora(model, LoRAArgs(rank=4, alpha=8.0, targets=["q_proj", "v_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.2)
    return model.eval()


def inside_layers(adapters: list[LoRALinear]) -> list[nn.Module]:
    return [sub for a in adapters for sub in (a.lora_A, a.lora_B)]


def test_packed_linears_packs_plain_and_merged_layers_and_leaves_the_model_as_it_was(monkeypatch):
    calls = []
    plain_linear = packed_linear.linear
    monkeypatch.setattr(
        packed_linear,
        "linear",
        lambda x, weight, bias: calls.append(weight.is_mkldnn) or plain_linear(x, weight, bias),
    )
    model = lora_model()
    tokens = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    adapters = [m for m in model.modules() if isinstance(m, LoRALinear)]
    inside = {id(sub) for sub in inside_layers(adapters)}
    plain = [m for m in model.modules() if type(m) is nn.Linear and id(m) not in inside]
    assert len(adapters) == 4 and len(plain) == 11  # 2 x (k, o, gate, up, down) + lm_head
    params = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    with torch.no_grad():
        adapted = model(tokens)
        with merged_adapters(model):
            merged = model(tokens)
            with packed_linears(model, rows=3) as count:
                calls.clear()
                packed = model(tokens)
                # every linear of the forward ran a packed weight
                assert calls == [True] * (len(adapters) + len(plain))
                assert all(a.merged_weight.is_mkldnn for a in adapters)  # in place of the copy
                assert all("forward" in m.__dict__ for m in plain)
                assert not any("forward" in sub.__dict__ for sub in inside_layers(adapters))
        after = model(tokens)
    assert count == len(adapters) + len(plain)  # not the adapters' A and B: unused merged
    torch.testing.assert_close(packed, merged, rtol=0, atol=1e-5)
    assert torch.equal(after, adapted)  # nothing left behind
    assert all("forward" not in m.__dict__ for m in plain)
    assert all(a.merged_weight is None for a in adapters)
    for name, p in model.named_parameters():
        assert p.data_ptr() == params[name][0] and torch.equal(p, params[name][1]), name


def test_weights_that_cannot_run_packed_are_left_alone():
    model = lora_model().to(torch.bfloat16)
    tokens = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with merged_adapters(model):
            merged = model(tokens)
            with packed_linears(model, rows=2) as count:
                assert count == 0
                assert not any("forward" in m.__dict__ for m in model.modules())
                assert torch.equal(model(tokens), merged)
