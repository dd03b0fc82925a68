"""Distillation losses against fp64 references written from the formulas (GKD eq. 1, TRL).

The references below compute probabilities with explicit ``exp / sum`` and the divergences as
plain sums of ``p * log(p / q)``, one position at a time, with the top-k support chosen by a
sort: none of the loss module's code paths.
"""

import sys
from pathlib import Path

import pytest
import torch

from tunelab.errors import ConfigError
from tunelab.losses import (
    DistillationLoss,
    ForwardKLLoss,
    GeneralizedJSDLoss,
    OutputLayer,
    ReverseKLLoss,
)

# The tracker bench/bench_distill.py measures the loss's memory with (one definition).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _live_tensors import LiveTensorBytes  # noqa: E402

sys.path.pop(0)

VOCAB = 11


def _probs(logits: torch.Tensor) -> torch.Tensor:
    weights = torch.exp(logits - logits.max())
    return weights / weights.sum()


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return sum(p[v] * torch.log(p[v] / q[v]) for v in range(len(p)) if p[v] > 0)


def reference_divergence(kind, beta, student, teacher, temperature, top_k):
    """One position's divergence, from the definitions."""
    student, teacher = student / temperature, teacher / temperature
    if top_k is not None:
        support = torch.argsort(teacher, descending=True)[:top_k]
        student, teacher = student[support], teacher[support]
    s, p = _probs(student), _probs(teacher)
    if kind == "forward" or (kind == "jsd" and beta == 0):
        return _kl(p, s)
    if kind == "reverse" or (kind == "jsd" and beta == 1):
        return _kl(s, p)
    m = beta * p + (1 - beta) * s
    return beta * _kl(p, m) + (1 - beta) * _kl(s, m)


def reference_loss(kind, beta, student, teacher, labels, temperature, top_k, nll_weight):
    """Summed loss, token count and metric sums over the shifted, unmasked positions."""
    total = torch.zeros((), dtype=torch.float64)
    metrics = dict.fromkeys(("distill", "nll", "teacher_kl", "student_entropy"), 0.0)
    count = 0
    for row in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[row, t + 1])
            if target == -100:
                continue
            count += 1
            d = reference_divergence(
                kind, beta, student[row, t], teacher[row, t], temperature, top_k
            )
            s_full, p_full = _probs(student[row, t]), _probs(teacher[row, t])
            nll = -torch.log(s_full[target])
            total = total + (1 - nll_weight) * d + nll_weight * nll
            metrics["distill"] += float(d)
            metrics["nll"] += float(nll)
            metrics["teacher_kl"] += float(_kl(p_full, s_full))
            metrics["student_entropy"] += float(-(s_full * torch.log(s_full)).sum())
    return total, count, metrics


def _make(kind, beta, **settings):
    if kind == "forward":
        return ForwardKLLoss(**settings)
    if kind == "reverse":
        return ReverseKLLoss(**settings)
    return GeneralizedJSDLoss(beta=beta, **settings)


def _data(seed=0, batch=3, seq=7):
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(batch, seq, VOCAB, generator=generator, dtype=torch.float64) * 2
    teacher = torch.randn(batch, seq, VOCAB, generator=generator, dtype=torch.float64) * 2
    labels = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    labels[0, :3] = -100  # a prompt
    labels[2, 5:] = -100  # padding
    return student, teacher, labels


CASES = [
    ("forward", None),
    ("reverse", None),
    ("jsd", 0.0),
    ("jsd", 0.3),
    ("jsd", 0.5),
    ("jsd", 1.0),
]


@pytest.mark.parametrize("kind,beta", CASES)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("top_k", [None, 4])
def test_each_loss_equals_its_fp64_reference(kind, beta, temperature, top_k):
    student, teacher, labels = _data()
    student.requires_grad_()
    loss_fn = _make(kind, beta, temperature=temperature, top_k=top_k, nll_weight=0.25)
    sums = loss_fn(student, teacher, labels)
    expected, count, metrics = reference_loss(
        kind, beta, student, teacher, labels, temperature, top_k, 0.25
    )
    assert int(sums.num_tokens) == count
    torch.testing.assert_close(sums.loss_sum, expected, rtol=0, atol=1e-10)
    for name, value in metrics.items():
        assert abs(float(sums.metrics[name]) - value) < 1e-10, name
    # The gradient too: autograd through the reference's sums against the loss's own path.
    (grad,) = torch.autograd.grad(sums.loss_sum, student)
    (expected_grad,) = torch.autograd.grad(expected, student)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-10)


def test_the_beta_limits_are_the_two_kls_and_jsd_is_symmetric_at_a_half():
    student, teacher, labels = _data(seed=1)
    forward = ForwardKLLoss()(student, teacher, labels).loss_sum
    reverse = ReverseKLLoss()(student, teacher, labels).loss_sum
    assert GeneralizedJSDLoss(beta=0.0)(student, teacher, labels).loss_sum == forward
    assert GeneralizedJSDLoss(beta=1.0)(student, teacher, labels).loss_sum == reverse
    half = GeneralizedJSDLoss(beta=0.5)
    torch.testing.assert_close(
        half(student, teacher, labels).loss_sum, half(teacher, student, labels).loss_sum
    )
    assert forward != reverse


def _output(weight: torch.Tensor) -> OutputLayer:
    return OutputLayer(lambda h: h @ weight.T, weight.requires_grad, weight.shape[0])


@pytest.mark.parametrize("kind,beta", [("forward", None), ("jsd", 0.4)])
@pytest.mark.parametrize("top_k", [None, 3])
@pytest.mark.parametrize("trainable_head", [True, False], ids=["trainable", "frozen"])
def test_chunked_hidden_states_equal_whole_logits(kind, beta, top_k, trainable_head):
    # A trainable output layer's chunks are checkpointed; a frozen one's row gradients are
    # computed in the forward: both equal the whole logits' autograd.
    generator = torch.Generator().manual_seed(2)
    student_hidden = torch.randn(3, 7, 5, generator=generator, dtype=torch.float64)
    teacher_hidden = torch.randn(3, 7, 9, generator=generator, dtype=torch.float64)
    student_head = torch.randn(VOCAB, 5, generator=generator, dtype=torch.float64)
    teacher_head = torch.randn(VOCAB, 9, generator=generator, dtype=torch.float64)
    _, _, labels = _data()
    results = []
    for chunks, chunked in ((1, False), (4, True), (100, True)):
        hidden = student_hidden.clone().requires_grad_()
        head = student_head.clone().requires_grad_(trainable_head)
        loss_fn = _make(kind, beta, temperature=1.7, top_k=top_k, num_chunks=chunks)
        if chunked:
            sums = loss_fn(hidden, teacher_hidden, labels, _output(head), _output(teacher_head))
        else:
            sums = loss_fn(hidden @ head.T, teacher_hidden @ teacher_head.T, labels)
        sums.loss_sum.backward()
        results.append((sums.loss_sum.detach(), hidden.grad, head.grad, sums.metrics))
    for loss, hidden_grad, head_grad, metrics in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=0, atol=1e-10)
        torch.testing.assert_close(hidden_grad, results[0][1], rtol=0, atol=1e-10)
        if trainable_head:
            torch.testing.assert_close(head_grad, results[0][2], rtol=0, atol=1e-10)
        for name in metrics:
            torch.testing.assert_close(metrics[name], results[0][3][name], rtol=0, atol=1e-10)


def test_no_scored_token_gives_zero_that_still_backpropagates():
    student, teacher, labels = _data()
    student.requires_grad_()
    sums = ForwardKLLoss()(student, teacher, torch.full_like(labels, -100))
    sums.loss_sum.backward()
    assert float(sums.loss_sum) == 0.0 and int(sums.num_tokens) == 0
    assert student.grad is not None and not student.grad.any()


@pytest.mark.parametrize(
    "settings,key",
    [
        ({"temperature": 0}, "loss.temperature"),
        ({"top_k": 0}, "loss.top_k"),
        ({"nll_weight": 1.5}, "loss.nll_weight"),
        ({"num_chunks": 0}, "loss.num_chunks"),
        ({"beta": 2.0}, "loss.beta"),
    ],
)
def test_bad_settings_name_their_key(settings, key):
    with pytest.raises(ConfigError, match=key):
        GeneralizedJSDLoss(**settings)


def test_chunked_loss_peak_memory_is_a_fraction_of_both_logits():
    # Forward and backward of the chunked loss on hidden states versus the two logits
    # tensors alone (not counting their log-softmax copies): at most 0.3x. At vocabulary 128k
    # and 4k tokens the default chunks (2**21 logits per model) are 1/256 of the positions;
    # here 1/64 of a smaller problem stands for them. The 128k figure is in
    # bench/bench_distill.py.
    tokens, vocab, dim = 512, 8192, 64
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, tokens, dim, generator=generator).requires_grad_()
    teacher_hidden = torch.randn(1, tokens, dim, generator=generator)
    head = torch.randn(vocab, dim, generator=generator) / 8
    teacher_head = torch.randn(vocab, dim, generator=generator) / 8
    labels = torch.randint(0, vocab, (1, tokens), generator=generator)
    loss_fn = ReverseKLLoss(num_chunks=64)
    with LiveTensorBytes() as tracker:
        sums = loss_fn(hidden, teacher_hidden, labels, _output(head), _output(teacher_head))
        sums.loss_sum.backward()
    both_logits = 2 * tokens * vocab * 4
    assert tracker.peak <= 0.3 * both_logits, (tracker.peak, both_logits)
    # The tracker does see a whole-logits computation (the check can fail).
    with LiveTensorBytes() as whole:
        ReverseKLLoss(num_chunks=1)(
            hidden, teacher_hidden, labels, _output(head), _output(teacher_head)
        ).loss_sum.backward()
    assert whole.peak > both_logits


class _AutogradJSD(DistillationLoss):
    # A loss that gives only its divergence: the base class differentiates it with autograd.
    def __init__(self, beta, **settings):
        super().__init__(**settings)
        self.closed_form = GeneralizedJSDLoss(beta=beta)

    def divergence(self, student_logps, teacher_logps):
        return self.closed_form.divergence(student_logps, teacher_logps)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("top_k", [None, 4])
def test_the_closed_form_gradient_equals_autograd_of_the_divergence(beta, top_k):
    student, teacher, labels = _data(seed=4)
    settings = {"temperature": 1.3, "top_k": top_k, "nll_weight": 0.4}
    results = []
    for loss_fn in (GeneralizedJSDLoss(beta=beta, **settings), _AutogradJSD(beta, **settings)):
        logits = student.clone().requires_grad_()
        sums = loss_fn(logits, teacher, labels)
        sums.loss_sum.backward()
        results.append((sums.loss_sum.detach(), logits.grad, sums.metrics))
    (loss, grad, metrics), (autograd_loss, autograd_grad, autograd_metrics) = results
    assert not _AutogradJSD(beta)._has_closed_form_gradient()
    torch.testing.assert_close(loss, autograd_loss, rtol=0, atol=1e-10)
    torch.testing.assert_close(grad, autograd_grad, rtol=0, atol=1e-10)
    for name in metrics:
        torch.testing.assert_close(metrics[name], autograd_metrics[name], rtol=0, atol=1e-10)


@pytest.mark.slow
def test_loss_peak_at_vocabulary_128k_and_4k_tokens_is_under_a_third_of_both_logits():
    # The figure: at vocabulary 128256 and 4096 scored tokens, the chunked loss's peak
    # (forward and backward, default chunks) is at most 0.3x the two fp32 logits tensors
    # (4 GiB). Measured at 512 and 1024 tokens with the same chunk size (MIN_CHUNK_ROWS
    # positions), the peak's growth per token carried to 4096: the chunks' temporaries are a
    # fixed part, and only [tokens, dim]-sized tensors grow with the tokens.
    from tunelab.losses.distillation import MIN_CHUNK_ROWS

    vocab, dim = 128256, 8
    generator = torch.Generator().manual_seed(5)
    heads = [torch.nn.Linear(dim, vocab, bias=False).requires_grad_(False) for _ in range(2)]
    peaks = {}
    for tokens in (512, 1024):
        hidden = torch.randn(1, tokens + 1, dim, generator=generator).requires_grad_()
        teacher_hidden = torch.randn(1, tokens + 1, dim, generator=generator)
        labels = torch.randint(0, vocab, (1, tokens + 1), generator=generator)
        loss_fn = ReverseKLLoss()
        assert loss_fn._chunk_count(tokens, vocab) == tokens // MIN_CHUNK_ROWS
        outputs = [OutputLayer(head, False, vocab) for head in heads]
        with LiveTensorBytes() as tracker:
            loss_fn(hidden, teacher_hidden, labels, *outputs).loss_sum.backward()
        peaks[tokens] = tracker.peak
    per_token = max(peaks[1024] - peaks[512], 0) / 512
    at_4096 = peaks[1024] + per_token * 3072
    both_logits = 2 * 4096 * vocab * 4
    assert at_4096 <= 0.3 * both_logits, (peaks, at_4096, both_logits)
