"""The router z-loss (ST-MoE eq. 5): ``RouterStats.z_loss`` against an fp64 reference, its
place in ``RouterLoss``'s objective and metrics, and the ``router.z_loss_coef`` setting."""

import pytest
import torch

from tunelab import ConfigError
from tunelab.cli._check import check_config
from tunelab.config.sections import RouterArgs
from tunelab.models import ModelArgs, TransformerDecoder
from tunelab.modules import RouterStats
from tunelab.training import RouterLoss


def _model() -> TransformerDecoder:
    args = ModelArgs(
        vocab_size=64, dim=16, num_layers=3, num_heads=2, num_kv_heads=1, intermediate_dim=24,
        family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_dim=8,
        dense_layers=[1],
    )  # fmt: skip
    torch.manual_seed(0)
    model = TransformerDecoder(args)
    with torch.no_grad():
        for layer in (model.layers[0], model.layers[2]):
            layer.mlp.gate.weight.normal_(0.0, 2.0)  # logits far from 0: a large log Z
    return model


def _router_logits(model, tokens) -> list[torch.Tensor]:
    """Each MoE layer's router logits ``[tokens, E]``, caught by hooks on the routers."""
    caught = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, out: caught.append(out.detach()))
        for layer in model.layers
        if hasattr(layer.mlp, "gate")
    ]
    model(tokens)
    for hook in hooks:
        hook.remove()
    return caught


def test_z_loss_equals_an_fp64_reference_with_padding_left_out():
    model = _model()
    tokens = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(tokens)
    valid[1, 4:] = 0
    logits = _router_logits(model, tokens)
    assert len(logits) == 2
    # Reference: sum over layers and counted tokens of log(sum_j exp(l_j))^2, over their count.
    mask = valid.reshape(-1).double()
    total = sum((torch.log(layer.double().exp().sum(-1)).square() * mask).sum() for layer in logits)
    expected = total / (len(logits) * mask.sum())
    stats = RouterStats(valid)
    model(tokens, router_stats=stats)
    ours = stats.z_loss()
    assert ours.dtype == torch.float32
    assert abs(ours.item() - expected.item()) <= 1e-5 * expected.item()
    unmasked = RouterStats()
    model(tokens, router_stats=unmasked)
    assert abs(unmasked.z_loss().item() - ours.item()) > 1e-3  # the mask matters
    ours.backward()
    router = model.layers[0].mlp.gate.weight.grad
    assert router is not None and float(router.abs().max()) > 0
    assert RouterStats().z_loss().item() == 0.0


def test_router_loss_adds_the_z_term_and_logs_it_apart():
    model = _model()
    tokens = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    batch = {"token_mask": torch.ones_like(tokens, dtype=torch.bool)}
    router_loss = RouterLoss(model, RouterArgs(aux_loss_coef=0.1, z_loss_coef=0.01))
    stats = router_loss.stats(batch)
    model(tokens, router_stats=stats)
    term = router_loss.term(stats, num_micro_batches=2)
    expected = (0.1 * stats.loss() + 0.01 * stats.z_loss()) / 2
    assert abs(term.item() - expected.item()) <= 1e-7
    metrics = router_loss.step_metrics()
    assert metrics == pytest.approx(
        {"router_aux_loss": stats.loss().item(), "router_z_loss": stats.z_loss().item()}
    )
    # Only the z-loss: the aux loss is neither added nor logged.
    z_only = RouterLoss(model, RouterArgs(aux_loss_coef=0.0, z_loss_coef=0.5))
    assert z_only.enabled
    stats = z_only.stats(batch)
    model(tokens, router_stats=stats)
    assert abs(z_only.term(stats, 1).item() - 0.5 * stats.z_loss().item()) <= 1e-6
    assert set(z_only.step_metrics()) == {"router_z_loss"}
    assert not RouterLoss(model, RouterArgs(aux_loss_coef=0.0, z_loss_coef=0.0)).enabled


def test_router_z_loss_coef_setting(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_config("tiny/moe_lora", ["router.z_loss_coef=0.001"])
    with pytest.raises(ConfigError, match="router.z_loss_coef"):
        check_config("tiny/moe_lora", ["router.z_loss_coef=-1"])
    # DPO has no router section: the key is unknown there.
    with pytest.raises(ConfigError, match="unknown key 'router' in config"):
        check_config("tiny/lora_dpo", ["router.z_loss_coef=0.001"])
