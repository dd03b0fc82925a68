"""The GRPO / DAPO / Dr. GRPO losses against plain fp64 loops written from the papers' formulas."""

import math

import pytest
import torch

from tunelab.losses import token_logps
from tunelab.rl import GRPOLoss, group_advantages, loss_normalizer


def reference_advantages(rewards: list[float], group_size: int, scale: bool) -> list[float]:
    # DeepSeekMath eq. 3 (std with Bessel's correction, eps 1e-4), Dr. GRPO without the std.
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out += [(r - mean) / (std + 1e-4) if scale else r - mean for r in group]
    return out


def reference_loss(logps, old, ref, adv, lengths, eps_low, eps_high, beta, aggregation, max_new):
    # l_it = -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A) + beta * (e^(ref-lp) - (ref-lp) - 1)
    per_sequence, total_tokens = [], 0
    for i, length in enumerate(lengths):
        terms = []
        for t in range(length):
            rho = math.exp(logps[i][t] - old[i][t])
            clipped = min(max(rho, 1 - eps_low), 1 + eps_high)
            term = -min(rho * adv[i], clipped * adv[i])
            d = ref[i][t] - logps[i][t]
            terms.append(term + beta * (math.exp(d) - d - 1))
        per_sequence.append(terms)
        total_tokens += length
    if aggregation == "sequence_mean":  # GRPO: mean over sequences of the token mean
        return sum(sum(s) / len(s) for s in per_sequence) / len(per_sequence)
    if aggregation == "token_mean":  # DAPO: every token weighs the same
        return sum(sum(s) for s in per_sequence) / total_tokens
    return sum(sum(s) for s in per_sequence) / (len(per_sequence) * max_new)  # Dr. GRPO


@pytest.mark.parametrize("scale", [True, False])
def test_advantages_on_hand_checked_groups(scale):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    advantages = group_advantages(rewards, 4, scale_rewards=scale)
    # Group 1: mean 0.5, std sqrt(1/3); group 2: all equal -> 0.
    expected = [0.5, -0.5, -0.5, 0.5] if not scale else [0.5 / (3**-0.5 + 1e-4)] * 4
    if scale:
        expected = [e * s for e, s in zip(expected, [1, -1, -1, 1], strict=True)]
    assert advantages[:4].tolist() == pytest.approx(expected, abs=1e-12)
    assert advantages[4:].tolist() == [0.0] * 4
    ref = reference_advantages(rewards.tolist(), 4, scale)
    torch.testing.assert_close(
        advantages, torch.tensor(ref, dtype=torch.float64), atol=1e-12, rtol=0
    )


def test_advantages_refuse_partial_groups():
    with pytest.raises(ValueError, match="groups"):
        group_advantages(torch.zeros(5), 4)


def test_clipping_on_a_hand_checked_token():
    loss = GRPOLoss(clip_eps_low=0.2, clip_eps_high=0.28)
    old = torch.zeros(4, 1, dtype=torch.float64)
    # ratios 1.5 (A>0: clipped to 1.28), 0.5 (A<0: clipped to 0.8), 1.5 (A<0: unclipped), 0.5 (A>0).
    logps = torch.log(torch.tensor([[1.5], [0.5], [1.5], [0.5]], dtype=torch.float64))
    logps.requires_grad_()
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    losses, sums = loss.token_losses(logps, old, adv, mask)
    assert losses.squeeze(1).tolist() == pytest.approx([-1.28, 0.8, 1.5, -0.5], abs=1e-12)
    assert sums["clipped"].item() == 2
    losses.sum().backward()
    # Clipped tokens carry no gradient; the others d(-rho A)/d logp = -rho A.
    assert logps.grad.squeeze(1).tolist() == pytest.approx([0.0, 0.0, 1.5, -0.5], abs=1e-12)


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant_length"])
@pytest.mark.parametrize(("eps_high", "beta"), [(0.2, 0.0), (0.28, 0.0), (0.2, 0.04)])
def test_every_variant_equals_the_fp64_reference(aggregation, eps_high, beta):
    generator = torch.Generator().manual_seed(0)
    batch, tokens, max_new = 6, 5, 7
    lengths = [5, 3, 1, 4, 5, 2]
    mask = torch.arange(tokens)[None] < torch.tensor(lengths)[:, None]
    logps = -torch.rand(batch, tokens, generator=generator, dtype=torch.float64) * 3
    old = logps + torch.randn(batch, tokens, generator=generator, dtype=torch.float64) * 0.3
    ref = logps + torch.randn(batch, tokens, generator=generator, dtype=torch.float64) * 0.3
    rewards = torch.rand(batch, generator=generator, dtype=torch.float64)
    adv = group_advantages(rewards, 3)
    loss = GRPOLoss(clip_eps_low=0.2, clip_eps_high=eps_high, beta=beta, aggregation=aggregation)
    # Two micro-batches, summed, then divided once by the step's normaliser.
    total = 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        losses, _ = loss.token_losses(logps[rows], old[rows], adv[rows], mask[rows], ref[rows])
        total = total + loss.loss_sum(losses, mask[rows])
    divisor = loss_normalizer(
        aggregation, num_sequences=batch, num_tokens=sum(lengths), max_new_tokens=max_new
    )
    expected = reference_loss(
        logps.tolist(), old.tolist(), ref.tolist(), adv.tolist(), lengths,
        0.2, eps_high, beta, aggregation, max_new,
    )  # fmt: skip
    assert abs(total.item() / divisor - expected) < 1e-10


def test_kl_metric_is_k3_and_needs_reference_when_beta():
    loss = GRPOLoss(beta=0.1)
    x = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="reference"):
        loss.token_losses(x, x, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool))
    ref = torch.tensor([[0.5, -0.5]], dtype=torch.float64)
    _, sums = loss.token_losses(x, x, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), ref)
    expected = sum(math.exp(d) - d - 1 for d in (0.5, -0.5))
    assert abs(sums["kl"].item() - expected) < 1e-12


def test_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="token_mean"):
        GRPOLoss(aggregation="mean")


def test_token_logps_through_the_chunked_output_equal_full_logits():
    from tunelab.losses import OutputLayer

    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 6, 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=generator, dtype=torch.float64)
    labels = torch.tensor([[-100, -100, 3, 4, 5, -100], [-100, 1, 2, -100, -100, -100]])
    output = OutputLayer(lambda h: h @ weight.T, trainable=False, vocab_size=11)
    chunked, mask = token_logps(hidden, labels, output=output, num_chunks=2)
    full, full_mask = token_logps(hidden @ weight.T, labels)
    assert torch.equal(mask, full_mask)
    torch.testing.assert_close(chunked, full, atol=1e-12, rtol=0)
