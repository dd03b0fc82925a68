"""The attention backends (sdpa, flex, dense) against the dense-mask path, fp32: packed and
unpacked rows, GQA, sliding window, soft-cap and gpt-oss's attention sinks.

What is tested where: on CPU, the forward of all three backends and the gradient of ``dense``
and ``sdpa``. torch 2.13 has no FlexAttention backward on CPU, so the ``flex`` gradient is
tested on CUDA only (``test_flex_gradient_equals_the_dense_mask_path``, which skips on CPU;
``bench/gpu_smoke.sh`` runs it and counts a skip as a failure).
"""

import logging

import pytest
import torch

from tunelab.models import ModelArgs, TransformerDecoder
from tunelab.modules.attention import resolve_attention_backend
from tunelab.modules.masks import AttentionMask, document_causal_mask

# Eager flex_attention (CPU) warns that it is the unfused debug path; that is what runs here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# Rows of 300 tokens: three flex blocks of 128, the last one partial.
_SEQ = 300
_LENGTHS = [[100, 150, 50], [40, 200, 60]]
_FAMILIES = {
    "gqa": {},
    "window_softcap": dict(  # Gemma 2's attention: alternating window, capped scores
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcap=20.0,
    ),
    "window_sinks": dict(  # gpt-oss's attention: alternating window, a sink logit per head
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        attention_sinks=True,
        qkv_bias=True,
        output_bias=True,
    ),
}


def _model(family: str) -> TransformerDecoder:
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_dim=64,
        **_FAMILIES[family],
    )  # fmt: skip
    model = TransformerDecoder(args)
    with torch.no_grad():
        for layer in model.layers:
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.normal_(0.0, 2.0)  # zeros would hide a sign error
    return model


def _document_ids() -> torch.Tensor:
    return torch.stack(
        [torch.repeat_interleave(torch.arange(3), torch.tensor(row)) for row in _LENGTHS]
    )


def _run(model: TransformerDecoder, tokens: torch.Tensor, packed: bool, backend: str | None):
    """Logits and the gradient of every parameter; backend None: the explicit dense mask."""
    model.zero_grad()
    device = tokens.device
    kwargs = {}
    if packed:
        kwargs["document_ids"] = _document_ids().to(device)
    if backend is None:
        model.attention_backend = "dense"
        if packed:
            ids = kwargs.pop("document_ids")
            kwargs = dict(mask=document_causal_mask(ids), input_pos=_positions(ids))
        else:
            causal = torch.ones(_SEQ, _SEQ, dtype=torch.bool, device=device).tril()
            kwargs = dict(mask=causal.expand(2, -1, -1))
    else:
        model.attention_backend = backend
    if backend == "flex" and tokens.device.type == "cpu":
        with torch.no_grad():  # torch 2.13: no FlexAttention backward on CPU
            return model(tokens, **kwargs), None
    logits = model(tokens, **kwargs)
    (logits * torch.linspace(-1, 1, logits.shape[-1], device=device)).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def _positions(ids: torch.Tensor) -> torch.Tensor:
    from tunelab.modules import positions_from_document_ids

    return positions_from_document_ids(ids)


@pytest.mark.parametrize("family", sorted(_FAMILIES))
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_backends_equal_the_dense_mask_path(family, packed):
    model = _model(family)
    tokens = torch.randint(0, 97, (2, _SEQ), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _run(model, tokens, packed, None)
    for backend in ("dense", "sdpa", "flex"):
        logits, grads = _run(model, tokens, packed, backend)
        # sdpa runs plain causal rows with is_causal (the path unpacked rows took before
        # issue 17), another kernel than a mask; with a mask its forward is bit-identical on
        # CPU, its gradient sums the GQA group's K/V gradients in another order than the
        # repeat's backward. flex is another kernel.
        # With sinks, sdpa adds a key column (another kernel than the explicit scores).
        sdpa_exact = {"gqa": packed, "window_softcap": True, "window_sinks": False}[family]
        exact = backend == "dense" or (backend == "sdpa" and sdpa_exact)
        assert (torch.equal if exact else _close)(logits, ref_logits), backend
        if backend == "flex":
            # No gradient on CPU (see the module docstring): flex's is checked on CUDA.
            assert grads is None
            continue
        same = torch.equal if backend == "dense" else _close
        for grad, ref in zip(grads, ref_grads, strict=True):
            assert same(grad, ref), backend


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to 1e-5 of the reference's largest entry (gradients sum many rounded terms)."""
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * max(1.0, b.abs().max().item()))
    return True


@pytest.mark.parametrize("family", ["window_softcap", "window_sinks"])
def test_flex_gradient_equals_the_dense_mask_path(family):
    """With sinks this checks the gradient through flex's returned log-sum-exp."""
    if not torch.cuda.is_available():
        pytest.skip("torch 2.13 has no FlexAttention backward on CPU; runs on CUDA")
    model = _model(family).cuda()
    tokens = torch.randint(0, 97, (2, _SEQ), generator=torch.Generator().manual_seed(1)).cuda()
    for packed in (False, True):
        ref_logits, ref_grads = _run(model, tokens, packed, None)
        logits, grads = _run(model, tokens, packed, "flex")
        assert _close(logits, ref_logits)
        assert all(_close(grad, ref) for grad, ref in zip(grads, ref_grads, strict=True))


@pytest.mark.parametrize("window", [None, 64])
def test_block_mask_blocks_agree_with_the_dense_mask(window):
    ids = _document_ids()
    described = AttentionMask(2, _SEQ, torch.device("cpu"), "flex", ids, window)
    dense = document_causal_mask(ids)
    if window is not None:
        index = torch.arange(_SEQ)
        dense = dense & (index[:, None] - index < window)
    assert torch.equal(described.dense()[:, 0], dense)
    block_mask = described.block_mask()
    padded = torch.zeros(2, 384, 384, dtype=torch.bool)
    padded[:, :_SEQ, :_SEQ] = dense
    blocks = padded.view(2, 3, 128, 3, 128).transpose(2, 3)  # [b, q block, k block, 128, 128]
    valid = torch.zeros(384, 384, dtype=torch.bool)
    valid[:_SEQ, :_SEQ] = True
    valid = valid.view(3, 128, 3, 128).transpose(1, 2)
    for b in range(2):
        for qb in range(3):
            partial = block_mask.kv_indices[b, 0, qb, : block_mask.kv_num_blocks[b, 0, qb]]
            full = block_mask.full_kv_indices[b, 0, qb, : block_mask.full_kv_num_blocks[b, 0, qb]]
            assert not set(partial.tolist()) & set(full.tolist())
            for kb in range(3):
                cells = blocks[b, qb, kb][valid[qb, kb]]
                if kb in full.tolist():
                    assert cells.all()
                elif kb in partial.tolist():
                    assert cells.any() and not cells.all()
                else:
                    assert not cells.any()
    # The same form is shared by every layer that gets this description.
    assert described.block_mask() is block_mask and described.dense() is described.dense()


def test_flex_training_on_cpu_is_refused_clearly():
    model = _model("gqa")
    model.attention_backend = "flex"
    with pytest.raises(ValueError, match="no FlexAttention backward on CPU"):
        model(torch.zeros(1, 4, dtype=torch.long), document_ids=torch.zeros(1, 4, dtype=torch.long))


def test_backend_choice_and_bad_input():
    assert resolve_attention_backend("auto", "cpu") == "sdpa"
    assert resolve_attention_backend("auto", torch.device("cuda", 0)) == "flex"
    assert resolve_attention_backend("dense", "cuda") == "dense"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_attention_backend("flash", "cpu")
    model = _model("gqa")
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="document_ids cannot be combined"):
        model(tokens, mask=torch.ones(1, 4, 4, dtype=torch.bool), document_ids=torch.zeros(1, 4))
    with pytest.raises(ValueError, match="document_ids shape"):
        model(tokens, document_ids=torch.zeros(1, 5, dtype=torch.long))


def test_build_model_resolves_the_setting_and_refuses_flex_training_on_cpu(
    tiny_hf_model_dir, caplog
):
    from tunelab.errors import ConfigError
    from tunelab.training import load_model

    path = str(tiny_hf_model_dir("llama3_2"))
    cpu = dict(device=torch.device("cpu"), dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="tunelab"):
        assert load_model(path, **cpu).attention_backend == "sdpa"
    assert "attention_backend auto: sdpa on cpu" in caplog.text
    assert load_model(path, **cpu, attention_backend="dense").attention_backend == "dense"
    with pytest.raises(ConfigError, match="attention_backend: flex cannot train on cpu"):
        load_model(path, **cpu, attention_backend="flex")
