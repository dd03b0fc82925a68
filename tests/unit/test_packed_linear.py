"""Linear weights packed for oneDNN (the rollout's decode matmuls on CPU; the frozen layers of
the GRPO update): the values of ``F.linear`` up to rounding, rows whose bits do not depend on
the batch, an update pass whose loss and gradients are the unpacked pass's, and a model left as
it was after the block."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tunelab.rl.step as step
from tunelab.config.lora import LoRAArgs
from tunelab.models.args import ModelArgs
from tunelab.models.decoder import TransformerDecoder
from tunelab.modules import Attention, FeedForward, packed_linear
from tunelab.modules.packed_linear import (
    PackedProjection,
    frozen_linear,
    linear,
    pack_weight,
    packable,
    packed_frozen_linears,
    packed_linears,
)
from tunelab.peft import LoRALinear, apply_lora, merged_adapters
from tunelab.rl import GRPOLoss, Rollout, policy_gradient_pass, rollout_batch, store_logps
from tunelab.rl.step import completion_logps
from tunelab.training import output_layer

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
    # q/k/v (merged q and v, plain k) and gate/up run as one packed matrix each
    groups = [m for m in model.modules() if isinstance(m, (Attention, FeedForward))]
    siblings = {id(sub) for group in groups for sub in group.sibling_projections()}
    alone = [m for m in plain if id(m) not in siblings]
    assert len(groups) == 4 and len(alone) == 5  # 2 x (o, down) + lm_head
    params = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    with torch.no_grad():
        adapted = model(tokens)
        with merged_adapters(model):
            merged = model(tokens)
            with packed_linears(model, rows=3) as count:
                calls.clear()
                packed = model(tokens)
                # every matmul of the forward ran a packed weight, one per group of siblings
                assert calls == [True] * (len(groups) + len(alone))
                for group in groups:
                    assert isinstance(group.packed_projection, PackedProjection)
                    assert group.packed_projection.weight.is_mkldnn
                # the merged copies made way for the packed matrices
                assert all(a.merged_weight is None for a in adapters)
                assert all("forward" in m.__dict__ for m in alone)
                assert not any("forward" in m.__dict__ for m in plain if id(m) in siblings)
                assert not any("forward" in sub.__dict__ for sub in inside_layers(adapters))
            assert all(group.packed_projection is None for group in groups)
        after = model(tokens)
    assert count == len(groups) + len(alone)  # not the adapters' A and B: unused merged
    torch.testing.assert_close(packed, merged, rtol=0, atol=1e-5)
    assert torch.equal(after, adapted)  # nothing left behind
    assert all("forward" not in m.__dict__ for m in plain)
    assert all(a.merged_weight is None for a in adapters)
    for name, p in model.named_parameters():
        assert p.data_ptr() == params[name][0] and torch.equal(p, params[name][1]), name


@pytest.mark.parametrize(
    "shape",
    [
        dict(dim=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_dim=48),
        # the GRPO bench's wide model (bench/bench_grpo.py), one layer
        dict(dim=768, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_dim=2048),
        # q/k normed per head (Qwen3): the split q, k and v, each rotated on its own
        dict(dim=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_dim=48, qk_norm=True),
    ],
    ids=["small", "wide", "qk_norm"],
)
@pytest.mark.parametrize("bias", [False, True])
def test_sibling_projections_as_one_packed_matrix_give_the_separate_bits(shape, bias):
    # One matmul for q/k/v and one for gate/up, with q and k rotated in one call: every logit
    # equal to the separately packed layers' (prefill rows and decode rows alike), so the
    # rollout samples the tokens it sampled with three and two matmuls.
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=211, num_layers=1, max_seq_len=64, qkv_bias=bias, **shape)
    model = TransformerDecoder(args)
    for param in model.parameters():
        nn.init.normal_(param, std=0.05)
    apply_lora(model, LoRAArgs(rank=8, alpha=16.0, targets=["q_proj", "k_proj", "up_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.05)
    model.eval()
    for rows, seq in ((16, 16), (16, 1), (32, 1), (3, 9)):
        tokens = torch.randint(0, 211, (rows, seq), generator=torch.Generator().manual_seed(rows))
        with torch.no_grad(), merged_adapters(model), packed_linears(model, rows) as count:
            assert count == 5  # qkv, o, gate/up, down, lm_head
            fused = model(tokens)
        with torch.no_grad(), merged_adapters(model), pytest.MonkeyPatch.context() as patch:
            patch.setattr(packed_linear, "_fuse_siblings", lambda module, rows: [])
            with packed_linears(model, rows) as count:
                assert count == 8
                alone = model(tokens)
        assert torch.equal(fused, alone), (rows, seq)


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


def spy_packs(monkeypatch) -> list[tuple[tuple[int, int], bool]]:
    """Record each ``pack_weight`` call: the packed shape, and whether it was a transpose."""
    packs = []
    pack = packed_linear.pack_weight

    def recording(weight, rows):
        packs.append((tuple(weight.shape), not weight.is_contiguous()))
        return pack(weight, rows)

    monkeypatch.setattr(packed_linear, "pack_weight", recording)
    return packs


def test_frozen_linear_packs_w_for_the_forward_and_w_t_for_the_input_gradient(monkeypatch):
    packs = spy_packs(monkeypatch)
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(3, 11, 64, requires_grad=True)
    grad = torch.randn(3, 11, 96)
    out = frozen_linear(x, weight, bias)
    out.backward(grad)
    plain_x = x.detach().requires_grad_()
    F.linear(plain_x, weight, bias).backward(grad)
    assert packs == [((96, 64), False), ((64, 96), True)]
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=0, atol=2e-5)
    torch.testing.assert_close(x.grad, plain_x.grad, rtol=0, atol=2e-5)
    with torch.no_grad():
        frozen_linear(x, weight, bias)
    assert len(packs) == 3  # no gradient: the forward's pack only
    # A weight that trains, or one that is not fp32, takes F.linear: it gets its gradient.
    trainable = weight.clone().requires_grad_()
    frozen_linear(x, trainable, bias).sum().backward()
    assert trainable.grad is not None
    assert frozen_linear(x.bfloat16(), weight.bfloat16(), None).dtype == torch.bfloat16
    assert len(packs) == 3


def grpo_rollouts(model: nn.Module) -> list[Rollout]:
    """Two micro-batches of GRPO groups (3 prompts x 4 completions of 1 to 7 tokens each).

    Their ``old_logps`` are the model's, moved by up to 0.05, so the ratios (0.95-1.05, none
    clipped) and the loss depend on the forward's values.
    """
    generator = torch.Generator().manual_seed(3)
    rollouts = []
    for _ in range(2):
        prompts, completions = [], []
        for length in (5, 9, 2):
            prompt = torch.randint(3, 97, (length,), generator=generator).tolist()
            for sample in range(4):
                prompts.append(prompt)
                size = 1 + (length + 2 * sample) % 7
                completions.append(torch.randint(3, 97, (size,), generator=generator).tolist())
        batch = rollout_batch(prompts, completions, 0, torch.device("cpu"))
        advantages = torch.randn(len(prompts), generator=generator)
        with torch.no_grad():
            logps, mask = completion_logps(model, batch, output_layer(model))
        shift = (torch.rand(logps.shape, generator=generator) - 0.5) * 0.1
        old = (logps + shift).masked_fill(~mask, 0.0)
        keep = torch.ones(len(prompts), dtype=torch.bool)
        rollouts.append(Rollout(batch, advantages, keep, old_logps=old))
    return rollouts


def update(model: nn.Module, rollouts: list[Rollout], monkeypatch=None):
    """The update pass (packed); with ``monkeypatch``, on unpacked weights (``F.linear``)."""
    model.zero_grad()
    loss_fn = GRPOLoss(aggregation="token_mean")
    with contextlib.ExitStack() as stack:
        if monkeypatch is not None:
            stack.enter_context(monkeypatch.context()).setattr(
                packed_linear, "packable", lambda weight: False
            )
        sums = policy_gradient_pass(model, rollouts, loss_fn, output_layer(model), scale=0.1)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return sums["loss"], grads


def assert_same_update(expected, actual) -> None:
    """Loss and every gradient within fp32 rounding (relative to each gradient's norm)."""
    (loss, grads), (other_loss, other_grads) = expected, actual
    assert other_loss == pytest.approx(loss, rel=1e-6)
    assert sorted(other_grads) == sorted(grads) and len(grads) == 8  # A and B of 4 adapters
    for name, grad in grads.items():
        error = (other_grads[name] - grad).norm() / grad.norm()
        assert error < 1e-6, (name, float(error))


def test_the_packed_update_pass_gives_the_unpacked_loss_and_gradients(monkeypatch):
    model = lora_model().train()
    rollouts = grpo_rollouts(model)
    unpacked = update(model, rollouts, monkeypatch)
    # The packed path on any CPU (an AVX2-only one runs the update unpacked: packing_pays).
    monkeypatch.setattr(step, "packing_pays", lambda: True)
    packs = spy_packs(monkeypatch)
    # Packed per call (GRPO's update): per micro-batch, every frozen layer's W packed in the
    # forward (2 adapted bases and 5 plain projections per block, lm_head), and W^T in the
    # backward, but for the first block's q, k and v, whose input needs no gradient (the
    # embedding is frozen).
    per_call = update(model, rollouts)
    forward_packs = [shape for shape, transposed in packs if not transposed]
    assert len(forward_packs) == 2 * 15 and forward_packs.count((97, 32)) == 2
    assert len(packs) - len(forward_packs) == 2 * 12
    assert_same_update(unpacked, per_call)
    assert all(m.pack_frozen is None for m in model.modules() if isinstance(m, LoRALinear))
    assert not any("forward" in m.__dict__ for m in model.modules())
    # Kept (``hold_bytes`` over their size): packed once, in the first micro-batch, and
    # reused by the next micro-batches and passes; the same bits as packing per call.
    monkeypatch.undo()
    monkeypatch.setattr(step, "packing_pays", lambda: True)
    monkeypatch.setattr(step, "_packed", lambda m: packed_frozen_linears(m, hold_bytes=1 << 40))
    packs = spy_packs(monkeypatch)
    for _ in range(2):
        loss, grads = update(model, rollouts)
        assert loss == per_call[0]
        assert all(torch.equal(grad, per_call[1][name]) for name, grad in grads.items())
    assert len(packs) == 15 + 12
    # The comparison sees a wrong packing: of W (loss and gradients move) or of W^T (the
    # gradients).
    monkeypatch.undo()  # GRPO's per-call packing again: drops the kept ones
    monkeypatch.setattr(step, "packing_pays", lambda: True)
    pack = packed_linear.pack_weight
    for wrong_transpose in (False, True):

        def wrong(weight, rows, wrong_transpose=wrong_transpose):
            if weight.is_contiguous() != wrong_transpose:
                weight = weight * (1 + 1e-4)
            return pack(weight, rows)

        monkeypatch.setattr(packed_linear, "pack_weight", wrong)
        with pytest.raises(AssertionError):
            assert_same_update(unpacked, update(model, rollouts))
    monkeypatch.setattr(packed_linear, "pack_weight", pack)
    # The no-grad passes before the update run packed too (the old and reference log-probs).
    output = output_layer(model)
    with torch.no_grad():
        expected = [completion_logps(model, r.batch, output)[0] for r in rollouts]
    store_logps(rollouts, model, output, old=True)
    for rollout, logps in zip(rollouts, expected, strict=True):
        torch.testing.assert_close(rollout.old_logps, logps, rtol=0, atol=1e-5)


def test_the_update_packs_where_the_cpu_has_avx512_kernels_only(monkeypatch):
    model = lora_model().train()
    rollouts = grpo_rollouts(model)
    for capability, packed in (("AVX2", False), ("DEFAULT", False), ("AVX512", True)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        packs = spy_packs(monkeypatch)
        update(model, rollouts)
        assert bool(packs) == packed, capability
        monkeypatch.undo()


def test_frozen_layers_run_packed_only_inside_the_block():
    model = lora_model()
    with packed_frozen_linears(model) as count:
        assert count == 4 + 11  # the adapted layers, the plain frozen ones (lm_head included)
        with packed_frozen_linears(model) as nested:
            assert nested == 0  # already set up: the outer block undoes it
        assert all(m.pack_frozen is not None for m in model.modules() if isinstance(m, LoRALinear))
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert not any(m.pack_frozen for m in model.modules() if isinstance(m, LoRALinear))
