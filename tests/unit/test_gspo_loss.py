"""GSPO's sequence-level loss and its gradient against plain fp64 loops from the paper's formulas.

GSPO (Zheng et al. 2025, arXiv:2507.18071, eq. 5-7): ``s_i = exp(mean_t(logp_it - old_it))``,
``L_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``, ``L = mean_i L_i``. The
reference here is written from those formulas with Python floats, not with tunelab's code; its
gradient is derived by hand: ``dL_i/dlogp_it = -A_i s_i / |o_i|`` where the unclipped term is
the one taken, 0 where the clipped one is (plus the KL's ``beta (1 - e^(ref - logp)) / |o_i|``).
"""

import math
from pathlib import Path

import pytest
import torch

from tunelab.config import GRPOArgs, instantiate, load_config, parse_args
from tunelab.errors import ConfigError
from tunelab.rl import GRPOLoss, GSPOLoss, PolicyLoss, check_policy_loss


def reference(logps, old, ref, adv, lengths, eps_low, eps_high, beta):
    """The loss and its gradient with respect to ``logps`` (per token), in fp64 plain loops."""
    num = len(lengths)
    loss, grad = 0.0, [[0.0] * len(row) for row in logps]
    for i, length in enumerate(lengths):
        s = math.exp(sum(logps[i][t] - old[i][t] for t in range(length)) / length)
        unclipped = s * adv[i]
        clipped = min(max(s, 1 - eps_low), 1 + eps_high) * adv[i]
        loss += -min(unclipped, clipped) / num
        # The clipped term is taken only when strictly smaller; then it is flat in s.
        ds = -adv[i] if unclipped <= clipped else 0.0
        for t in range(length):
            d = ref[i][t] - logps[i][t]
            loss += beta * (math.exp(d) - d - 1) / length / num
            grad[i][t] = (ds * s / length + beta * (1 - math.exp(d)) / length) / num
    return loss, grad


@pytest.mark.parametrize(
    ("eps_low", "eps_high", "beta"), [(3e-4, 4e-4, 0.0), (0.2, 0.28, 0.0), (3e-4, 4e-4, 0.05)]
)
def test_loss_and_gradient_equal_the_fp64_reference(eps_low, eps_high, beta):
    generator = torch.Generator().manual_seed(0)
    batch, tokens = 8, 6
    lengths = [6, 3, 1, 4, 6, 2, 5, 6]
    mask = torch.arange(tokens)[None] < torch.tensor(lengths)[:, None]
    logps = -torch.rand(batch, tokens, generator=generator, dtype=torch.float64) * 3
    # Sequence ratios a little off 1 (some inside GSPO's narrow clip range, some outside) ...
    old = logps + torch.randn(batch, tokens, generator=generator, dtype=torch.float64) * 1e-3
    # ... and a policy that moved further for the wide range.
    old[:2] = logps[:2] + torch.randn(2, tokens, generator=generator, dtype=torch.float64) * 0.4
    ref = logps + torch.randn(batch, tokens, generator=generator, dtype=torch.float64) * 0.3
    # Padding positions hold values that must not count (finite: the KL's exp stays finite).
    logps = torch.where(mask, logps, torch.full_like(logps, 7.0)).requires_grad_()
    adv = torch.randn(batch, generator=generator, dtype=torch.float64)
    loss_fn = GSPOLoss(clip_eps_low=eps_low, clip_eps_high=eps_high, beta=beta)
    # Two micro-batches, summed, then divided once by the step's normaliser (the recipe's way).
    total = 0.0
    clipped_tokens = 0.0
    for rows in (slice(0, 3), slice(3, 8)):
        losses, sums = loss_fn.token_losses(
            logps[rows], old[rows], adv[rows], mask[rows], ref[rows] if beta else None
        )
        total = total + loss_fn.loss_sum(losses, mask[rows])
        clipped_tokens += sums["clipped"].item()
    divisor = loss_fn.normalizer(num_sequences=batch, num_tokens=sum(lengths), max_new_tokens=9)
    assert divisor == batch  # sequence_mean: the paper's 1/G over the completions
    (total / divisor).backward()
    expected, expected_grad = reference(
        logps.tolist(), old.tolist(), ref.tolist(), adv.tolist(), lengths, eps_low, eps_high, beta
    )
    assert abs(total.item() / divisor - expected) < 1e-12
    torch.testing.assert_close(
        logps.grad, torch.tensor(expected_grad, dtype=torch.float64), atol=1e-12, rtol=0
    )
    # The data hit both cases: some completions clipped (no gradient), some not.
    assert 0 < clipped_tokens < sum(lengths)


def test_a_hand_checked_sequence_ratio():
    # One completion of two tokens with log-ratios 0.3 and -0.1: s = e^0.1 = 1.10517.
    old = torch.zeros(3, 2, dtype=torch.float64)
    logps = torch.tensor([[0.3, -0.1]] * 3, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.bool)
    losses, sums = GSPOLoss(clip_eps_low=0.2, clip_eps_high=0.05).token_losses(
        logps, old, adv, mask
    )
    s = math.exp(0.1)
    # A > 0: clipped to 1.05 (no gradient); A < 0: -min(-s, -1.05) = s; A = 2: 2 * 1.05.
    assert losses[:, 0].tolist() == pytest.approx([-1.05, s, -2.1], abs=1e-12)
    assert losses[:, 0].tolist() == losses[:, 1].tolist()  # every token carries its L_i
    assert sums["clipped"].item() == 4  # the tokens of the two clipped completions
    losses.sum().backward()
    # Only row 1 (unclipped) has a gradient: its 2 tokens carry s each, d(2 s)/d logp_t = s.
    expected = torch.tensor([[0.0, 0.0], [s, s], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logps.grad, expected, atol=1e-12, rtol=0)


def test_the_policy_loss_base_class_and_its_check():
    assert issubclass(GSPOLoss, PolicyLoss) and issubclass(GRPOLoss, PolicyLoss)
    assert GSPOLoss().aggregation == "sequence_mean"
    assert check_policy_loss(GSPOLoss(), "grpo_distributed") == GSPOLoss()
    with pytest.raises(ConfigError, match="needs a policy loss .* got dict"):
        check_policy_loss({}, "grpo_distributed")
    with pytest.raises(ValueError, match="reference"):
        x = torch.zeros(1, 2)
        GSPOLoss(beta=0.1).token_losses(x, x, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool))


def test_the_documented_new_loss_is_one_file_and_a_config_line(tmp_path, monkeypatch):
    # docs/losses.md's example, as written there: one class in one file ...
    docs = (Path(__file__).resolve().parents[2] / "docs" / "losses.md").read_text()
    section = docs.split("### Adding a policy loss", 1)[1]
    (tmp_path / "my_losses.py").write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    # ... plus a config line: the shipped GRPO config with its loss swapped, nothing else.
    overrides = ["loss._component_=my_losses.UnclippedLoss"]
    overrides += [f"~loss.{key}" for key in ("clip_eps_low", "clip_eps_high", "aggregation")]
    cfg = load_config("tiny/grpo", overrides)
    args = parse_args(cfg, GRPOArgs)
    loss_fn = check_policy_loss(instantiate(args.loss), "grpo_distributed")
    assert type(loss_fn).__name__ == "UnclippedLoss" and loss_fn.beta == 0.0
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[True, False]])
    losses, _ = loss_fn.token_losses(logps, logps.detach(), torch.tensor([2.0]), mask)
    assert loss_fn.loss_sum(losses, mask).item() == -2.0  # -rho A, rho 1, one token


def test_grpo_loss_is_the_default_and_null_is_refused():
    # A GRPO config without a loss node trains with GRPOLoss's defaults ...
    args = parse_args(load_config("tiny/grpo", ["~loss"]), GRPOArgs)
    assert instantiate(args.loss) == GRPOLoss()
    # ... and one that sets it to null is told what it needs.
    with pytest.raises(ConfigError, match="key 'loss' is required"):
        parse_args(load_config("tiny/grpo", ["loss=null"]), GRPOArgs)
