"""KTO and ORPO against TRL's formulas, rewritten here in fp64 from TRL 1.16's trainers.

The references follow ``KTOTrainer._compute_loss`` (summed completion log-probs, the KL
estimate ``max(0, mean(pi' - ref'))`` from the mismatched pairs, the per-label losses
concatenated and averaged) and ``ORPOTrainer.odds_ratio_loss`` / ``concatenated_forward``
(length-averaged log-probs for the odds ratio, the token-mean cross-entropy of the chosen rows,
``loss = nll - mean(beta * logsigmoid(log_odds))``), from logits and padded labels, and are
compared with tunelab's path (``sequence_logps``, the loss classes, ``step_kl``) on values and
gradients at 1e-10.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tunelab.errors import ConfigError
from tunelab.losses import KTOLoss, ORPOLoss, PreferenceLoss, UnpairedPreferenceLoss, sequence_logps
from tunelab.training.kto import step_kl
from tunelab.training.reference import ReferenceLogps

VOCAB = 11
TOL = dict(rtol=0, atol=1e-10)


def _logits_and_labels(rows: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 logits and labels with a masked prompt and right padding of varying length."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, seq, VOCAB, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    labels[:, :2] = -100
    for row in range(rows):
        labels[row, seq - (row % 4) :] = -100  # padding: 0 to 3 positions
    return logits, labels


def _trl_batch_logps(logits, labels, average):
    """TRL's ``get_batch_logps``: shift, mask ``-100``, sum (or average) the token log-probs."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    mask = labels != -100
    labels[~mask] = 0
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    if average:
        return (per_token * mask).sum(-1) / mask.sum(-1)
    return (per_token * mask).sum(-1)


# -- KTO ------------------------------------------------------------------------------------


def _trl_kto(policy, reference, policy_kl, reference_kl, desirable, beta, dw, uw):
    """TRL's KTO loss on summed log-probs (one process: the gather is the identity)."""
    kl = (policy_kl - reference_kl).mean().detach().clamp(min=0)
    chosen_idx = torch.nonzero(desirable).view(-1)
    rejected_idx = torch.nonzero(~desirable).view(-1)
    chosen = policy[chosen_idx] - reference[chosen_idx]
    rejected = policy[rejected_idx] - reference[rejected_idx]
    chosen_losses = 1 - torch.sigmoid(beta * (chosen - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected))
    losses = torch.cat((dw * chosen_losses, uw * rejected_losses), 0)
    return losses.nanmean(), kl, beta * chosen.detach(), beta * rejected.detach()


def _kto_case(labels_desirable, seed, *, tie_rows=()):
    rows = len(labels_desirable)
    logits, labels = _logits_and_labels(rows, 9, seed)
    ref_logits, _ = _logits_and_labels(rows, 9, seed + 100)
    kl_logits, kl_labels = _logits_and_labels(rows, 9, seed + 200)
    ref_kl_logits, _ = _logits_and_labels(rows, 9, seed + 300)
    for row in tie_rows:  # policy == reference: a zero implied reward
        ref_logits[row] = logits[row]
    return logits, labels, ref_logits, kl_logits, kl_labels, ref_kl_logits


@pytest.mark.parametrize(
    ("desirable", "tie_rows", "weights"),
    [
        ([True, False, True, False, False], (), (1.0, 1.0)),
        ([True, True, True, True], (1, 2), (1.0, 1.0)),  # all desirable, with ties
        ([False, False, False], (0,), (1.0, 1.0)),  # all undesirable
        ([True, False, False, False, True, False], (3,), (1.33, 0.7)),  # imbalanced, weighted
    ],
)
@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_kto_equals_trl(desirable, tie_rows, weights, beta):
    logits, labels, ref_logits, kl_logits, kl_labels, ref_kl_logits = _kto_case(
        desirable, seed=len(desirable), tie_rows=tie_rows
    )
    desirable = torch.tensor(desirable)
    ours_logits = logits.clone().requires_grad_(True)
    trl_logits = logits.clone().requires_grad_(True)

    # TRL: completion log-probs with grad, mismatched ones without, reference without.
    with torch.no_grad():
        trl_kl = _trl_batch_logps(kl_logits, kl_labels, average=False)
        trl_ref = _trl_batch_logps(ref_logits, labels, average=False)
        trl_ref_kl = _trl_batch_logps(ref_kl_logits, kl_labels, average=False)
    expected, expected_kl, chosen_rewards, rejected_rewards = _trl_kto(
        _trl_batch_logps(trl_logits, labels, average=False),
        trl_ref, trl_kl, trl_ref_kl, desirable, beta, *weights,
    )  # fmt: skip
    expected.backward()

    # tunelab: sequence_logps, step_kl (the mismatched pairs), KTOLoss, mean over rows.
    with torch.no_grad():
        policy_kl = sequence_logps(kl_logits, kl_labels)[0]
        reference_kl = sequence_logps(ref_kl_logits, kl_labels)[0]
        reference = sequence_logps(ref_logits, labels)[0]
    kl = step_kl([policy_kl], [ReferenceLogps(chosen_logps=reference, rejected_logps=reference_kl)])
    loss_fn = KTOLoss(beta=beta, desirable_weight=weights[0], undesirable_weight=weights[1])
    policy = sequence_logps(ours_logits, labels)[0]
    losses, rewards = loss_fn(policy, reference, desirable, kl)
    losses.mean().backward()

    torch.testing.assert_close(kl, expected_kl, **TOL)
    torch.testing.assert_close(losses.mean(), expected, **TOL)
    torch.testing.assert_close(ours_logits.grad, trl_logits.grad, **TOL)
    torch.testing.assert_close(rewards[desirable], chosen_rewards, **TOL)
    torch.testing.assert_close(rewards[~desirable], rejected_rewards, **TOL)
    assert not rewards.requires_grad


def test_kto_kl_is_clamped_at_zero_and_detached():
    policy_kl = torch.tensor([-5.0, -7.0], dtype=torch.float64, requires_grad=True)
    reference = ReferenceLogps(
        chosen_logps=torch.zeros(2), rejected_logps=torch.tensor([-4.0, -6.0])
    )
    kl = step_kl([policy_kl], [reference])
    assert kl.item() == 0.0 and not kl.requires_grad  # mean(pi' - ref') = -1, clamped
    kl = step_kl([policy_kl + 3.0], [reference])
    assert kl.item() == pytest.approx(2.0, abs=1e-12)


def test_kto_at_policy_equal_reference_is_half_the_weights():
    logps = torch.tensor([-3.0, -9.0, -1.5], dtype=torch.float64)
    desirable = torch.tensor([True, False, True])
    losses, rewards = KTOLoss(beta=0.5, desirable_weight=2.0, undesirable_weight=0.5)(
        logps, logps.clone(), desirable, torch.zeros((), dtype=torch.float64)
    )
    assert losses.tolist() == [1.0, 0.25, 1.0] and rewards.tolist() == [0.0, 0.0, 0.0]


def test_kto_settings_are_checked():
    for bad in ({"beta": 0}, {"desirable_weight": -1.0}, {"undesirable_weight": "1"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            KTOLoss(**bad)
    assert isinstance(KTOLoss(), UnpairedPreferenceLoss) and KTOLoss.needs_reference


# -- ORPO -----------------------------------------------------------------------------------


def _log1mexp(x):
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _trl_orpo(logits, labels, beta):
    """TRL's ORPO loss on one concatenated batch (chosen rows first), NLL on ``labels``."""
    pairs = logits.shape[0] // 2
    chosen_logits = logits[:pairs, :-1, :].reshape(-1, VOCAB)
    chosen_labels = labels[:pairs, 1:].reshape(-1)
    nll = F.cross_entropy(chosen_logits, chosen_labels, ignore_index=-100)
    logps = _trl_batch_logps(logits, labels, average=True)
    chosen, rejected = logps[:pairs], logps[pairs:]
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    losses = beta * F.logsigmoid(log_odds)
    return nll - losses.mean(), beta * chosen.detach(), beta * rejected.detach()


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_equals_trl(tie, beta):
    logits, labels = _logits_and_labels(8, 10, seed=7)
    if tie:  # pairs 0 and 2: rejected identical to chosen, log_odds = 0
        for pair in (0, 2):
            logits[4 + pair], labels[4 + pair] = logits[pair], labels[pair]
    ours_logits = logits.clone().requires_grad_(True)
    trl_logits = logits.clone().requires_grad_(True)
    expected, chosen_rewards, rejected_rewards = _trl_orpo(trl_logits, labels, beta)
    expected.backward()

    logps, lengths, _ = sequence_logps(ours_logits, labels)
    loss_fn = ORPOLoss(beta=beta)
    losses, chosen, rejected = loss_fn(logps[:4], logps[4:], None, None, lengths[:4], lengths[4:])
    losses.mean().backward()

    torch.testing.assert_close(losses.mean(), expected, **TOL)
    torch.testing.assert_close(ours_logits.grad, trl_logits.grad, **TOL)
    torch.testing.assert_close(chosen, chosen_rewards, **TOL)
    torch.testing.assert_close(rejected, rejected_rewards, **TOL)


def test_orpo_step_nll_is_the_token_mean_over_micro_batches():
    # Two micro-batches with the step's tokens-per-pair: the mean of their summed losses is
    # TRL's loss on the whole step as one batch (the NLL a mean over all chosen tokens).
    logits, labels = _logits_and_labels(8, 10, seed=11)
    whole = _trl_orpo(logits, labels, 0.2)[0]
    logps, lengths, _ = sequence_logps(logits, labels)
    chosen_tokens_per_pair = lengths[:4].sum() / 4
    total = 0.0
    for pairs in ([0, 1, 2], [3]):  # micro-batches of unequal size
        losses, _, _ = ORPOLoss(beta=0.2)(
            logps[:4][pairs], logps[4:][pairs], None, None, lengths[:4][pairs],
            lengths[4:][pairs], chosen_tokens_per_pair=chosen_tokens_per_pair,
        )  # fmt: skip
        total = total + losses.sum()
    torch.testing.assert_close(total / 4, whole, **TOL)


def test_orpo_is_reference_free_and_checked():
    assert isinstance(ORPOLoss(), PreferenceLoss)
    assert not ORPOLoss.needs_reference and ORPOLoss.adds_chosen_nll
    with pytest.raises(ConfigError, match="beta"):
        ORPOLoss(beta=0.0)
