"""The DPO family against its formulas, on fixed log-probs with hand-computed values."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from tunelab.config import instantiate
from tunelab.errors import ConfigError, TunelabError
from tunelab.losses import DPOLoss, HingeLoss, IPOLoss, SimPOLoss

# Two pairs. Pair 0: chosen ratio pi_c - ref_c = -10 - (-11) = 1, rejected ratio
# pi_r - ref_r = -12 - (-11.5) = -0.5, so h = 1.5. Pair 1: ratios -1 and -21, h = 20.
PI_C = [-10.0, -20.0]
PI_R = [-12.0, -30.0]
REF_C = [-11.0, -19.0]
REF_R = [-11.5, -9.0]
LEN_C = [4, 10]
LEN_R = [5, 2]


def _logps(requires_grad: bool = False):
    def t(values):
        return torch.tensor(values, dtype=torch.float64, requires_grad=requires_grad)

    return t(PI_C), t(PI_R), t(REF_C), t(REF_R), torch.tensor(LEN_C), torch.tensor(LEN_R)


def _softplus(x: float) -> float:
    """-log(sigmoid(-x)) = log(1 + e^x), written out by hand."""
    return math.log(1.0 + math.exp(x))


def _close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-12, rtol=0
    )


def test_dpo_sigmoid_hand_computed():
    losses, chosen, rejected = DPOLoss(beta=0.1)(*_logps())
    # -log(sigmoid(beta * h)) = log(1 + exp(-beta * h)), beta * h = 0.15 and 2.0.
    _close(losses, [_softplus(-0.15), _softplus(-2.0)])
    _close(chosen, [0.1 * 1.0, 0.1 * -1.0])
    _close(rejected, [0.1 * -0.5, 0.1 * -21.0])


def test_dpo_label_smoothing_is_conservative_dpo():
    losses, _, _ = DPOLoss(beta=0.1, label_smoothing=0.2)(*_logps())
    expected = [0.8 * _softplus(-bh) + 0.2 * _softplus(bh) for bh in (0.15, 2.0)]
    _close(losses, expected)


def test_dpo_gradient_matches_formula():
    pi_c, pi_r, ref_c, ref_r, len_c, len_r = _logps(requires_grad=True)
    losses, chosen, _ = DPOLoss(beta=0.1)(pi_c, pi_r, ref_c, ref_r, len_c, len_r)
    losses.sum().backward()
    # d/d pi_c of -log sigmoid(beta h) = -beta * sigmoid(-beta h) = -beta / (1 + e^{beta h}).
    _close(pi_c.grad, [-0.1 / (1 + math.exp(0.15)), -0.1 / (1 + math.exp(2.0))])
    _close(pi_r.grad, [0.1 / (1 + math.exp(0.15)), 0.1 / (1 + math.exp(2.0))])
    assert not chosen.requires_grad


@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_dpo_at_policy_equal_reference_is_ln2_with_zero_rewards(label_smoothing):
    policy_c, policy_r = torch.tensor([-7.0, -3.5]), torch.tensor([-9.0, -1.25])
    losses, chosen, rejected = DPOLoss(beta=0.1, label_smoothing=label_smoothing)(
        policy_c, policy_r, policy_c.clone(), policy_r.clone()
    )
    torch.testing.assert_close(losses, torch.full((2,), math.log(2)))
    assert chosen.tolist() == [0.0, 0.0] and rejected.tolist() == [0.0, 0.0]


def test_ipo_is_length_normalised_squared_loss():
    losses, chosen, rejected = IPOLoss(tau=0.1)(*_logps())
    # Pair 0: chosen ratio (-10/4) - (-11/4) = 0.25, rejected (-12/5) - (-11.5/5) = -0.1.
    # Pair 1: chosen (-20/10) - (-19/10) = -0.1, rejected (-30/2) - (-9/2) = -10.5.
    h = [0.25 - (-0.1), -0.1 - (-10.5)]
    _close(losses, [(h[0] - 1 / (2 * 0.1)) ** 2, (h[1] - 5.0) ** 2])
    _close(chosen, [0.1 * 0.25, 0.1 * -0.1])
    _close(rejected, [0.1 * -0.1, 0.1 * -10.5])


def test_hinge_hand_computed():
    losses, chosen, rejected = HingeLoss(beta=0.1)(*_logps())
    _close(losses, [1 - 0.15, 0.0])  # pair 1: 1 - 0.1 * 20 < 0, clipped to 0
    _close(chosen, [0.1, -0.1])
    _close(rejected, [-0.05, -2.1])


def test_simpo_hand_computed_and_reference_free():
    pi_c, pi_r, ref_c, ref_r, len_c, len_r = _logps()
    loss = SimPOLoss(beta=2.0, gamma=0.5)
    losses, chosen, rejected = loss(pi_c, pi_r, None, None, len_c, len_r)
    # Pair 0: 2 * (-10/4 - -12/5) - 0.5 = -0.7; pair 1: 2 * (-20/10 - -30/2) - 0.5 = 25.5.
    _close(losses, [_softplus(0.7), _softplus(-25.5)])
    _close(chosen, [2.0 * -2.5, 2.0 * -2.0])
    _close(rejected, [2.0 * -2.4, 2.0 * -15.0])
    # Reference log-probs, if passed anyway, change nothing.
    with_reference = loss(pi_c, pi_r, ref_c * 3, ref_r - 7, len_c, len_r)
    for got, want in zip(with_reference, (losses, chosen, rejected)):
        assert torch.equal(got, want)


def test_capabilities():
    assert DPOLoss.needs_reference and not DPOLoss.length_normalized
    assert IPOLoss.needs_reference and IPOLoss.length_normalized
    assert HingeLoss.needs_reference and not HingeLoss.length_normalized
    assert not SimPOLoss.needs_reference and SimPOLoss.length_normalized
    assert not SimPOLoss().needs_reference


def test_missing_inputs_are_reported():
    pi_c, pi_r, ref_c, ref_r, len_c, len_r = _logps()
    with pytest.raises(TunelabError, match="DPOLoss needs reference log-probs"):
        DPOLoss()(pi_c, pi_r)
    with pytest.raises(TunelabError, match="IPOLoss is length-normalised"):
        IPOLoss()(pi_c, pi_r, ref_c, ref_r)
    with pytest.raises(TunelabError, match="SimPOLoss is length-normalised"):
        SimPOLoss()(pi_c, pi_r)


def test_zero_length_does_not_produce_nan():
    losses, _, _ = SimPOLoss()(
        torch.tensor([0.0]), torch.tensor([-2.0]), None, None, torch.tensor([0]), torch.tensor([1])
    )
    assert torch.isfinite(losses).all()


@pytest.mark.parametrize(
    ("factory", "key"),
    [
        (lambda: DPOLoss(beta=0.0), "loss.beta"),
        (lambda: DPOLoss(label_smoothing=0.5), "loss.label_smoothing"),
        (lambda: DPOLoss(label_smoothing=-0.1), "loss.label_smoothing"),
        (lambda: IPOLoss(tau=-1.0), "loss.tau"),
        (lambda: HingeLoss(beta="big"), "loss.beta"),
        (lambda: SimPOLoss(beta=0), "loss.beta"),
    ],
)
def test_bad_hyperparameters_are_config_errors(factory, key):
    with pytest.raises(ConfigError, match=key):
        factory()


def test_built_from_component_node():
    node = OmegaConf.create(
        {"_component_": "tunelab.losses.DPOLoss", "beta": 0.5, "label_smoothing": 0.1}
    )
    loss = instantiate(node)
    assert isinstance(loss, DPOLoss) and loss.beta == 0.5 and loss.label_smoothing == 0.1
