"""Selective activation checkpointing (every k-th block, attention only) and activation
offloading: the same gradients, fewer saved activations, and the settings' errors.

What the forward keeps for the backward is measured with ``saved_tensors_hooks``: the tensors
autograd saves outside checkpointed regions (a checkpointed region saves nothing but its
input, which it holds itself, and recomputes the rest in backward).
"""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tunelab.distributed import apply_activation_checkpointing
from tunelab.errors import ConfigError
from tunelab.models import ModelArgs, TransformerDecoder
from tunelab.training import ActivationOffload


def _model(**checkpointing) -> TransformerDecoder:
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=97, dim=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_dim=64
    )
    model = TransformerDecoder(args)
    model.attention_backend = "sdpa"
    if checkpointing:
        apply_activation_checkpointing(model, **checkpointing)
    return model


def _saved_bytes_and_grads(model: TransformerDecoder) -> tuple[int, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 97, (2, 256), generator=torch.Generator().manual_seed(0))
    parameters = {param.data_ptr() for param in model.parameters()}
    saved = []

    def pack(tensor):
        if tensor.data_ptr() not in parameters:  # weights are not activations
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
    return sum(saved), {name: param.grad for name, param in model.named_parameters()}


def test_selective_checkpointing_keeps_gradients_and_saves_less():
    plain_bytes, plain_grads = _saved_bytes_and_grads(_model())
    measured = {}
    for name, settings in {
        "every block": dict(every=1),
        "every 2nd block": dict(every=2),
        "attention only": dict(scope="attention"),
    }.items():
        measured[name], grads = _saved_bytes_and_grads(_model(**settings))
        for key, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[key], rtol=0, atol=1e-7, msg=key)
    assert measured["every block"] < measured["every 2nd block"] < plain_bytes, measured
    assert measured["every block"] < measured["attention only"] < plain_bytes, measured
    # Every 2nd of 4 blocks: half the blocks keep theirs (and the embedding, norm, logits).
    block_bytes = (plain_bytes - measured["every block"]) / 4
    assert measured["every 2nd block"] == pytest.approx(measured["every block"] + 2 * block_bytes)


def test_selective_checkpointing_errors():
    with pytest.raises(ConfigError, match="activation_checkpointing_every must be at least 1"):
        apply_activation_checkpointing(_model(), every=0)
    with pytest.raises(ConfigError, match="activation_checkpointing_scope must be one of"):
        apply_activation_checkpointing(_model(), scope="mlp")


def test_selective_keys_need_checkpointing_on():
    tunelab = Path(sys.executable).with_name("tunelab")
    result = subprocess.run(
        [str(tunelab), "validate", "tiny/lora", "model.activation_checkpointing_every=2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == (
        "tunelab: error: key 'model.activation_checkpointing_every': it selects what activation "
        "checkpointing recomputes; set model.activation_checkpointing: true"
    )


def test_offloading_is_a_no_op_said_once_on_cpu(caplog):
    with caplog.at_level(logging.WARNING, logger="tunelab.training.loop"):
        offload = ActivationOffload(True, torch.device("cpu"))
    assert not offload.active
    assert [record.getMessage() for record in caplog.records] == [
        "offload_activations: activations on cpu already live in host memory: no-op"
    ]
    model = _model()
    with offload():
        saved_bytes, _ = _saved_bytes_and_grads(model)
    assert saved_bytes > 0
    assert ActivationOffload(False, torch.device("cuda"))().__class__.__name__ == "nullcontext"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading needs CUDA")
def test_offloading_on_cuda_keeps_gradients_and_moves_saved_tensors_to_the_host():
    model = _model().cuda()
    tokens = torch.randint(0, 97, (2, 256), device="cuda")
    expected = model(tokens).float().logsumexp(-1).mean()
    expected.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    torch.cuda.synchronize()
    offload = ActivationOffload(True, torch.device("cuda"))
    before = torch.cuda.memory_allocated()
    with offload():
        loss = model(tokens).float().logsumexp(-1).mean()
    kept_offloaded = torch.cuda.memory_allocated() - before
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], msg=name)
    model.zero_grad()
    before = torch.cuda.memory_allocated()
    loss = model(tokens).float().logsumexp(-1).mean()
    kept = torch.cuda.memory_allocated() - before
    assert kept_offloaded < kept / 2, (kept_offloaded, kept)
