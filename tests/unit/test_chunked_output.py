"""Chunked output layer: the loss applies lm_head per sequence chunk; results equal the logits path.

Values and gradients (hidden states, lm_head, LoRA adapters) of ``CrossEntropyLoss`` and
``sequence_logps`` given the hidden states and an ``OutputLayer`` equal those given the whole
logits, through a frozen and a trainable output layer, with ignored positions, and the whole
``[batch, seq, vocab]`` tensor is never saved for the backward.
"""

import pytest
import torch

import tunelab.peft as peft
from tunelab.config.lora import LoRAArgs
from tunelab.losses import CrossEntropyLoss, OutputLayer, sequence_logps
from tunelab.models import ModelArgs, TransformerDecoder
from tunelab.training import batch_loss, output_layer

IGNORE = -100
BATCH, SEQ, DIM, VOCAB = 3, 11, 16, 41


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, DIM, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels[0, :4] = IGNORE  # a prompt
    labels[2, -3:] = IGNORE  # padding
    head = torch.nn.Linear(DIM, VOCAB, bias=False, dtype=torch.float64)
    torch.nn.init.normal_(head.weight, std=0.5, generator=generator)
    return hidden, labels, head


def _grads(loss: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


@pytest.mark.parametrize("trainable", [False, True])
@pytest.mark.parametrize("num_chunks", [1, 3, 64])
def test_cross_entropy_from_hidden_equals_full_logits(trainable, num_chunks):
    hidden, labels, head = _inputs()
    head.weight.requires_grad_(trainable)
    loss_fn = CrossEntropyLoss(num_chunks=num_chunks)
    expected_h = hidden.clone().requires_grad_()
    expected, expected_count = loss_fn(head(expected_h), labels)
    actual_h = hidden.clone().requires_grad_()
    output = OutputLayer(head, trainable=trainable, vocab_size=VOCAB)
    actual, actual_count = loss_fn(actual_h, labels, output=output)
    assert actual_count == expected_count
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)
    wrt = [head.weight] if trainable else []
    # Uneven per-token weights reach the chunks' gradients as they do the full logits'.
    scale = 0.37
    for got, want in zip(
        _grads(actual * scale, actual_h, *wrt), _grads(expected * scale, expected_h, *wrt)
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("trainable", [False, True])
def test_sequence_logps_from_hidden_equals_full_logits(trainable):
    hidden, labels, head = _inputs(1)
    head.weight.requires_grad_(trainable)
    expected_h = hidden.clone().requires_grad_()
    expected = sequence_logps(head(expected_h), labels, num_chunks=4)
    actual_h = hidden.clone().requires_grad_()
    actual = sequence_logps(
        actual_h, labels, num_chunks=4, output=OutputLayer(head, trainable, VOCAB)
    )
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # DPO weighs each row differently: the per-row weights must reach each row's gradient.
    weights = torch.tensor([1.5, -0.25, 3.0], dtype=torch.float64)
    wrt = [head.weight] if trainable else []
    got = _grads((actual[0] * weights).sum(), actual_h, *wrt)
    want = _grads((expected[0] * weights).sum(), expected_h, *wrt)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def test_no_grad_and_a_single_token():
    hidden, labels, head = _inputs(2)
    output = OutputLayer(head, trainable=False, vocab_size=VOCAB)
    with torch.no_grad():
        loss, count = CrossEntropyLoss()(hidden, labels, output=output)
        expected, _ = CrossEntropyLoss()(head(hidden), labels)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    one = hidden[:, :1].clone().requires_grad_()
    loss, count = CrossEntropyLoss()(one, labels[:, :1], output=output)
    assert count == 0 and loss == 0
    loss.backward()  # every rank must be able to take part in the backward
    assert one.grad is not None and not one.grad.any()


def _model(tie: bool = False) -> TransformerDecoder:
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=VOCAB, dim=DIM, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_dim=32, tie_embeddings=tie,
    )  # fmt: skip
    return TransformerDecoder(args)


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = tokens.clone()
    labels[1, :5] = IGNORE
    return {"tokens": tokens, "labels": labels}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_model_loss_and_gradients_equal_unchunked(lora):
    model = _model(tie=not lora)
    if lora:
        peft.apply_lora(
            model, LoRAArgs(targets=["q_proj", "v_proj", "down_proj"], rank=4, alpha=8.0)
        )
        peft.set_trainable_params(model)
        with torch.no_grad():  # B = 0 would hide the adapters' gradients through the base
            for param in peft.get_adapter_params(model).values():
                param.normal_(0, 0.1)
    trainable = [p for p in model.parameters() if p.requires_grad]
    output = output_layer(model)
    assert output.trainable is not lora
    loss_fn = CrossEntropyLoss(num_chunks=4)
    batch = _batch()
    expected, _ = batch_loss(loss_fn, model, batch)
    expected_grads = torch.autograd.grad(expected, trainable)
    actual, _ = batch_loss(loss_fn, model, batch, output)
    actual_grads = torch.autograd.grad(actual, trainable)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    for got, want in zip(actual_grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("trainable", [False, True])
def test_whole_logits_are_never_kept_for_the_backward(trainable):
    batch, seq, dim = 4, 64, 8  # long rows: the logits dwarf the weight and the hidden states
    hidden = torch.randn(batch, seq, dim, requires_grad=True)
    labels = torch.randint(0, VOCAB, (batch, seq))
    head = torch.nn.Linear(dim, VOCAB, bias=False).requires_grad_(trainable)
    output = OutputLayer(head, trainable=trainable, vocab_size=VOCAB)
    saved = []

    def pack(tensor):
        # Elements of memory behind the tensor (an expanded weight is no copy).
        saved.append(tensor.untyped_storage().nbytes() // tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, _ = CrossEntropyLoss(num_chunks=8)(hidden, labels, output=output)
    loss.backward()
    whole_logits = batch * (seq - 1) * VOCAB
    assert max(saved) <= whole_logits / 4  # a chunk's logits, the hidden states, the weight
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        CrossEntropyLoss(num_chunks=8)(head(hidden), labels)
    assert max(saved) >= whole_logits  # the check above would see whole logits


@pytest.mark.parametrize("trainable", [False, True])
def test_only_scored_positions_go_through_the_output_layer(trainable):
    # A prompt, padding and a row with no target at all: the output layer sees exactly the
    # scored positions' hidden rows (the DPO prompt half never gets logits), and the loss
    # and gradients still equal the whole-logits path.
    hidden, labels, head = _inputs(3)
    labels[1] = IGNORE
    head.weight.requires_grad_(trainable)
    seen = []

    def forward(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.detach().clone())
        return head(rows)

    actual_h = hidden.clone().requires_grad_()
    output = OutputLayer(forward, trainable=trainable, vocab_size=VOCAB)
    actual, _ = CrossEntropyLoss(num_chunks=3)(actual_h, labels, output=output)
    scored = labels[:, 1:] != IGNORE
    expected_rows = hidden[:, :-1][scored]
    torch.testing.assert_close(torch.cat(seen), expected_rows, rtol=0, atol=0)
    expected_h = hidden.clone().requires_grad_()
    expected, _ = CrossEntropyLoss()(head(expected_h), labels)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)
    wrt = [head.weight] if trainable else []
    got = _grads(actual, actual_h, *wrt)
    for g, want in zip(got, _grads(expected, expected_h, *wrt)):
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
    assert got[0][1].abs().max() == 0  # the unscored row gets nothing


def test_a_rank_with_no_scored_position_still_runs_backward():
    # Every label ignored (a rank whose rows are all prompt): an empty product, a zero loss
    # that still reaches the graph, so backward (and FSDP2's collectives) run on every rank.
    hidden, labels, head = _inputs(4)
    labels[:] = IGNORE
    actual_h = hidden.clone().requires_grad_()
    output = OutputLayer(head, trainable=False, vocab_size=VOCAB)
    loss, count = CrossEntropyLoss()(actual_h, labels, output=output)
    assert count == 0 and loss.item() == 0.0
    (grad,) = torch.autograd.grad(loss, actual_h)
    assert grad.abs().max() == 0


def test_chunk_count_by_size_or_as_asked():
    from tunelab.losses._token_logps import CHUNK_LOGITS, chunk_count

    assert chunk_count(None, 1024, 8192) == 1  # 8M logits: one efficient product
    assert chunk_count(None, 1024, 128256) == 8  # 131M logits: 8 pieces of <= 2**24
    assert chunk_count(None, 4096, 128256) * CHUNK_LOGITS >= 4096 * 128256
    assert chunk_count(None, 0, 128256) == 1  # no scored position: one empty piece
    assert chunk_count(3, 1024, 8192) == 3  # as asked
    assert chunk_count(64, 10, 8192) == 10  # never more pieces than positions


def test_default_chunking_equals_explicit_pieces():
    hidden, labels, head = _inputs(5)
    output = OutputLayer(head, trainable=False, vocab_size=VOCAB)
    by_size, _ = CrossEntropyLoss()(hidden, labels, output=output)
    in_pieces, _ = CrossEntropyLoss(num_chunks=5)(hidden, labels, output=output)
    torch.testing.assert_close(by_size, in_pieces, rtol=0, atol=1e-12)
