"""Cross-entropy sum and count, sequence log-probs: hand values and torch references."""

import math

import pytest
import torch
import torch.nn.functional as F

from tunelab.errors import ConfigError
from tunelab.losses import CrossEntropyLoss, sequence_logps, token_count

IGNORE = -100


def _hand_logits() -> torch.Tensor:
    """One row, 3 positions, vocab 3, with softmaxes that are easy to write by hand.

    position 0: logits [0, 0, 0]            -> p = [1/3, 1/3, 1/3]
    position 1: logits [0, ln 2, ln 3]      -> p = [1/6, 2/6, 3/6]
    position 2: logits [100, -100, 5]       -> predicts nothing (last position)
    """
    return torch.tensor(
        [[[0.0, 0.0, 0.0], [0.0, math.log(2), math.log(3)], [100.0, -100.0, 5.0]]],
        dtype=torch.float64,
    )


def _reference_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, vocab).double(),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


def _random_batch(seed: int = 0, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 9, 13, generator=generator).to(dtype)
    labels = torch.randint(0, 13, (3, 9), generator=generator)
    labels[0, :4] = IGNORE  # a masked prompt
    labels[2, 6:] = IGNORE  # padding
    return logits, labels


def test_shift_hand_computed():
    # logits[:, 0] scores labels[:, 1] = 1: -ln(1/3); logits[:, 1] scores labels[:, 2] = 2:
    # -ln(3/6). Without the shift the sum would include the huge last position.
    loss_sum, num_tokens = CrossEntropyLoss()(_hand_logits(), torch.tensor([[0, 1, 2]]))
    assert loss_sum.item() == pytest.approx(math.log(3) + math.log(2), abs=1e-12)
    assert num_tokens.item() == 2


def test_ignore_index_hand_computed():
    loss_sum, num_tokens = CrossEntropyLoss()(_hand_logits(), torch.tensor([[0, 1, IGNORE]]))
    assert loss_sum.item() == pytest.approx(math.log(3), abs=1e-12)
    assert num_tokens.item() == 1
    loss_sum, num_tokens = CrossEntropyLoss(ignore_index=7)(
        _hand_logits(), torch.tensor([[0, 7, 2]])
    )
    assert loss_sum.item() == pytest.approx(math.log(2), abs=1e-12)
    assert num_tokens.item() == 1


def test_sum_count_and_gradient_match_torch_cross_entropy():
    logits, labels = _random_batch()
    logits = logits.double().requires_grad_()
    loss_sum, num_tokens = CrossEntropyLoss(num_chunks=3)(logits, labels)
    expected = _reference_sum(logits, labels)
    assert loss_sum.item() == pytest.approx(expected.item(), abs=1e-10)
    assert num_tokens.item() == (labels[:, 1:] != IGNORE).sum().item() == 18
    (grad,) = torch.autograd.grad(loss_sum * 0.7, logits)
    (expected_grad,) = torch.autograd.grad(expected * 0.7, logits)
    torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("num_chunks", [2, 3, 8, 100])
def test_chunked_equals_unchunked(num_chunks):
    logits, labels = _random_batch(seed=1)
    whole = logits.clone().requires_grad_()
    chunked = logits.clone().requires_grad_()
    sum_whole, count_whole = CrossEntropyLoss(num_chunks=1)(whole, labels)
    sum_chunked, count_chunked = CrossEntropyLoss(num_chunks=num_chunks)(chunked, labels)
    torch.testing.assert_close(sum_chunked, sum_whole, atol=1e-5, rtol=0)
    assert count_chunked.item() == count_whole.item()
    sum_whole.backward()
    sum_chunked.backward()
    torch.testing.assert_close(chunked.grad, whole.grad, atol=1e-6, rtol=0)


def test_low_precision_logits_sum_in_fp32_and_keep_no_fp32_copy():
    logits, labels = _random_batch(seed=2, dtype=torch.bfloat16)
    logits.requires_grad_()
    saved_bytes = []

    def pack(tensor):
        saved_bytes.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_sum, _ = CrossEntropyLoss(num_chunks=4)(logits, labels)
    assert loss_sum.dtype == torch.float32
    expected = _reference_sum(logits.detach(), labels)
    assert loss_sum.item() == pytest.approx(expected.item(), rel=1e-6)
    # Saved for backward: the bf16 logits themselves plus the labels and mask, never an
    # fp32 [batch, seq, vocab] copy (which alone would be twice the logits' bytes).
    logit_bytes = logits.numel() * logits.element_size()
    assert sum(saved_bytes) < logit_bytes + 2 * labels.numel() * 8
    loss_sum.backward()
    assert logits.grad.dtype == torch.bfloat16
    reference = logits.detach().float().requires_grad_()
    _reference_sum(reference, labels).backward()
    # The fp32 gradient rounded once to bf16: within half a bf16 ulp, at most 2**-8 of each
    # value (the values are ~0.05-1, so an absolute 1e-2 would let most of them be wrong),
    # and exactly zero where nothing is scored.
    torch.testing.assert_close(logits.grad.float(), reference.grad, atol=0, rtol=2**-8)


def test_no_target_tokens_gives_zero_that_still_backpropagates():
    logits = torch.randn(2, 4, 5, requires_grad=True)
    labels = torch.full((2, 4), IGNORE)
    loss_sum, num_tokens = CrossEntropyLoss()(logits, labels)
    assert loss_sum.item() == 0.0 and num_tokens.item() == 0
    loss_sum.backward()
    assert torch.count_nonzero(logits.grad) == 0
    single = torch.randn(2, 1, 5, requires_grad=True)
    loss_sum, num_tokens = CrossEntropyLoss()(single, torch.zeros(2, 1, dtype=torch.long))
    assert loss_sum.item() == 0.0 and num_tokens.item() == 0
    loss_sum.backward()
    assert single.grad is not None


def test_token_count_matches_loss_count():
    _, labels = _random_batch(seed=3)
    assert token_count(labels).item() == CrossEntropyLoss()(*_random_batch(seed=3))[1].item()
    assert token_count(torch.tensor([[5, IGNORE, 3, 4]])).item() == 2  # first label never counts
    assert token_count(torch.tensor([[5, 0, 3]]), ignore_index=0).item() == 1


@pytest.mark.parametrize("num_chunks", [0, -1, 1.5, True])
def test_bad_num_chunks_is_a_config_error(num_chunks):
    with pytest.raises(ConfigError, match="loss.num_chunks"):
        CrossEntropyLoss(num_chunks=num_chunks)


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match=r"labels \[batch, seq\]"):
        CrossEntropyLoss()(torch.zeros(1, 3, 4), torch.zeros(1, 2, dtype=torch.long))


def test_sequence_logps_hand_computed():
    logits = _hand_logits().expand(3, 3, 3)
    labels = torch.tensor([[IGNORE, 1, 2], [IGNORE, IGNORE, 2], [IGNORE, IGNORE, IGNORE]])
    sum_logps, num_tokens, mean_logits = sequence_logps(logits, labels)
    # Row 0: log(1/3) + log(3/6); row 1: log(3/6) only; row 2: no completion.
    expected = [math.log(1 / 3) + math.log(1 / 2), math.log(1 / 2), 0.0]
    torch.testing.assert_close(sum_logps, torch.tensor(expected, dtype=torch.float64))
    assert num_tokens.tolist() == [2, 1, 0]
    # Mean over vocab and completion positions: position 0 sums to 0, position 1 to ln 6.
    expected_means = [math.log(6) / 6, math.log(6) / 3, 0.0]
    torch.testing.assert_close(mean_logits, torch.tensor(expected_means))
    assert not mean_logits.requires_grad


def test_sequence_logps_sum_to_minus_cross_entropy_and_differentiate():
    logits, labels = _random_batch(seed=4)
    logits.requires_grad_()
    sum_logps, num_tokens, _ = sequence_logps(logits, labels, num_chunks=2)
    per_row = [-_reference_sum(logits[i : i + 1], labels[i : i + 1]).item() for i in range(3)]
    torch.testing.assert_close(sum_logps.detach(), torch.tensor(per_row), atol=1e-5, rtol=0)
    assert num_tokens.tolist() == (labels[:, 1:] != IGNORE).sum(-1).tolist()
    sum_logps[1].backward()
    assert torch.count_nonzero(logits.grad[0]) == 0 and torch.count_nonzero(logits.grad[1]) > 0
