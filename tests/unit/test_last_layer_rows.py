"""The last decoder layer at the scored positions only (``forward(rows=...)``).

A loss reads the final hidden states at its scored positions only, so ``training.forward``
with an output layer has the last layer attend at every position and compute the rest
(``o_proj``, residuals, norms, MLP or experts, the final norm) at the scored rows. For each
family (llama, Gemma 2 and Gemma 3 with sliding windows, soft-caps and sandwich norms, a
mixture of experts, Qwen2.5-VL, Qwen3-VL with deepstack, Gemma 3 VL), on padded and packed
rows, the loss and the gradients (LoRA adapters, or every parameter) equal the full path's
within 1e-6 in fp32; a forward with any rows, image tokens included, equals the full
forward's rows; and the last MLP sees only the scored rows (a hook counts them), unless a
router loss needs every token's routing or the last layer draws dropout masks.
"""

import json

import pytest
import torch

import tunelab.peft as peft
from tunelab._paths import assets_dir
from tunelab.config.lora import LoRAArgs
from tunelab.data import image_chat_dataset, load_tokenizer, sft_collate
from tunelab.distributed import apply_activation_checkpointing
from tunelab.losses import (
    CrossEntropyLoss,
    ForwardKLLoss,
    OutputLayer,
    scored_rows,
    sequence_logps,
)
from tunelab.models import TransformerDecoder, args_from_hf, from_hf_config, load_pretrained
from tunelab.modules import positions_from_document_ids
from tunelab.modules.moe import RouterStats
from tunelab.training import output_layer
from tunelab.training.loop import forward
from tunelab.training.shared_prompts import forward_sharing_prompts

IGNORE = -100
VOCAB = 97
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"]
_HF = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip
TEXT_FAMILIES = {
    "llama": dict(_HF, model_type="llama"),
    # Sliding window then full; attention and final soft-caps; sandwich norms; tied head.
    "gemma2": dict(_HF, model_type="gemma2", head_dim=8, sliding_window=4),
    # The last layer a sliding one: its window and the document mask at all queries.
    "gemma3_text": dict(
        _HF, model_type="gemma3_text", head_dim=8, sliding_window=4,
        layer_types=["full_attention", "sliding_attention"],
    ),
    "qwen3_moe": dict(
        _HF, model_type="qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, norm_topk_prob=True,
    ),
}  # fmt: skip
VL_FAMILIES = {
    "qwen2_5_vl": "tiny_vl",
    "qwen3_vl": "tiny_qwen3_vl",
    "gemma3_vl": "tiny_gemma3_vl",
}


def _text_model(family: str) -> TransformerDecoder:
    torch.manual_seed(0)
    model = TransformerDecoder(args_from_hf(TEXT_FAMILIES[family]))
    with torch.no_grad():  # sharper attention than the default init, so masking errors show
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
    return model.train()


def _text_batch(packed: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, 12), generator=generator)
    labels = tokens.clone()
    labels[:, :4] = IGNORE  # prompts
    if not packed:
        labels[2, -5:] = IGNORE  # padding
        return {"tokens": tokens, "labels": labels}
    document_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12, [0] * 3 + [1] * 4 + [2] * 5])
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    labels = torch.where(starts, IGNORE, tokens)  # no document predicts the next one's start
    labels[0, 5:8] = IGNORE  # a prompt inside a pack
    return {
        "tokens": tokens,
        "labels": labels,
        "document_ids": document_ids,
        "input_pos": positions_from_document_ids(document_ids),
    }


def _vl_batch(family: str, packed: bool, tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    folder = assets_dir() / VL_FAMILIES[family]
    tokenizer = load_tokenizer(folder, max_seq_len=256)
    rows = image_chat_dataset(
        tokenizer, source="json", data_files=str(assets_dir() / "tiny_vl" / "chat.jsonl"),
        max_seq_len=256, num_proc=1, cache_dir=str(tmp_path / "cache"), packed=packed,
    )  # fmt: skip
    count = 2 if packed else 3
    batch = sft_collate(tokenizer)([rows[i] for i in range(count)], pad_id=tokenizer.pad_id)
    return folder, batch


def _adapt(model: TransformerDecoder, lora: bool) -> list[torch.nn.Parameter]:
    """LoRA on the language model's projections (B random, so its gradients show), or all."""
    if lora:
        targets = MOE_TARGETS if model.args.num_experts else TARGETS
        peft.apply_lora(model, LoRAArgs(targets=targets, rank=4, alpha=8.0))
        peft.set_trainable_params(model)
        with torch.no_grad():
            for param in peft.get_adapter_params(model).values():
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    return [param for param in model.parameters() if param.requires_grad]


def _loss_and_grads(model, batch, params, trim: bool):
    """The mean token loss of ``batch`` and its gradients, through ``training.forward``."""
    output = output_layer(model)
    given = batch if trim else {key: value for key, value in batch.items() if key != "labels"}
    states = forward(model, given, output)  # without labels: every position
    num_scored = int((batch["labels"][:, 1:] != IGNORE).sum())
    assert states.shape[:-1] == ((num_scored,) if trim else batch["tokens"].shape)
    loss_sum, num_tokens = CrossEntropyLoss()(states, batch["labels"], output=output)
    loss = loss_sum / num_tokens
    return loss.detach(), torch.autograd.grad(loss, params)


def _assert_trim_is_exact(model, batch, params):
    """Loss and gradients within 1e-6 of the full path's.

    fp64: within 1e-6 absolute (only what computes in fp32 by design, Gemma's norm scale,
    rounds there at all: a few 1e-8). fp32: within 1e-6 of each gradient's scale (its
    largest entry, at least 1): a sum over other rows rounds in another order, and the
    embedding's gradient (entries up to ~10, each the sum of many positions' terms) differs
    by up to ~3e-6 on the tiny Gemma 3 VL.
    """
    loss, grads = _loss_and_grads(model, batch, params, trim=True)
    full_loss, full_grads = _loss_and_grads(model, batch, params, trim=False)
    torch.testing.assert_close(loss, full_loss, rtol=0, atol=1e-6)
    assert len(grads) == len(params) > 0
    fp32 = params[0].dtype == torch.float32
    for got, want in zip(grads, full_grads, strict=True):
        scale = max(1.0, want.abs().max().item()) if fp32 else 1.0
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * scale)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])


@DTYPES
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("family", sorted(TEXT_FAMILIES))
def test_text_families_loss_and_gradients_equal_the_full_path(family, packed, lora, dtype):
    model = _text_model(family).to(dtype)
    params = _adapt(model, lora)
    _assert_trim_is_exact(model, _text_batch(packed), params)


@pytest.mark.parametrize("scope", ["block", "attention"])
def test_activation_checkpointing_recomputes_the_trimmed_last_layer(scope):
    model = _text_model("gemma2")
    params = _adapt(model, lora=True)
    apply_activation_checkpointing(model, scope=scope)
    _assert_trim_is_exact(model, _text_batch(packed=True), params)


@DTYPES
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("family", sorted(VL_FAMILIES))
def test_vision_language_loss_and_gradients_equal_the_full_path(
    family, packed, lora, dtype, tmp_path
):
    folder, batch = _vl_batch(family, packed, tmp_path)
    assert "pixel_values" in batch and ("document_ids" in batch) == packed
    model = load_pretrained(folder, dtype=dtype).train()
    params = _adapt(model, lora)  # full: the vision tower and projector too
    if not lora:
        assert any(name.startswith(("visual.", "vision_tower.")) for name, _ in
                   model.named_parameters())  # fmt: skip
    _assert_trim_is_exact(model, batch, params)


def _deepstack_on_last_layer(tmp_path) -> tuple[TransformerDecoder, dict[str, torch.Tensor]]:
    """The tiny Qwen3-VL with deepstack features after both layers (the last one's too)."""
    source = assets_dir() / "tiny_qwen3_vl"
    config = json.loads((source / "config.json").read_text())
    config["vision_config"]["deepstack_visual_indexes"] = [0, 1]
    torch.manual_seed(0)
    model = from_hf_config(config).eval()
    _, batch = _vl_batch("qwen3_vl", False, tmp_path)
    return model, batch


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_vl_deepstack"])
def test_any_rows_equal_the_full_forwards_rows(family, tmp_path):
    if family == "qwen3_vl_deepstack":
        model, batch = _deepstack_on_last_layer(tmp_path)
        assert len(model.visual.deepstack_merger_list) == len(model.layers)
        visual = {key: batch[key] for key in ("pixel_values", "image_grid_thw")}
    else:
        model, batch, visual = _text_model(family).eval(), _text_batch(False), {}
    tokens = batch["tokens"]
    # Every third position, image tokens among them, in no particular order.
    rows = torch.arange(tokens.numel()).flip(0)[::3]
    with torch.no_grad():
        full = model(tokens, **visual, return_hidden=True)
        some = model(tokens, **visual, return_hidden=True, rows=rows)
        logits = model(tokens, **visual, rows=rows)
    if visual:
        image = (tokens == model.args.vision.image_token_id).reshape(-1)
        assert image[rows].any()
    torch.testing.assert_close(some, full.reshape(-1, full.shape[-1])[rows], rtol=0, atol=1e-6)
    torch.testing.assert_close(logits, model.output(some), rtol=0, atol=0)


def _mlp_rows(model: TransformerDecoder, run) -> list[int]:
    """The rows each layer's MLP receives during ``run()``."""
    seen = [0] * len(model.layers)
    handles = [
        layer.mlp.register_forward_pre_hook(
            lambda module, args, index=index: seen.__setitem__(
                index, seen[index] + args[0].reshape(-1, args[0].shape[-1]).shape[0]
            )
        )
        for index, layer in enumerate(model.layers)
    ]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_the_last_mlp_sees_only_the_scored_rows(family):
    model = _text_model(family)
    batch = _text_batch(packed=True)
    output = output_layer(model)
    positions = batch["tokens"].numel()
    scored = int((batch["labels"][:, 1:] != IGNORE).sum())
    assert 0 < scored < positions
    assert _mlp_rows(model, lambda: forward(model, batch, output)) == [positions, scored]
    # Without the chunked output layer the logits of every position are returned.
    assert _mlp_rows(model, lambda: forward(model, batch)) == [positions, positions]
    if family == "qwen3_moe":  # a router loss counts the last layer's routing of every token
        stats = RouterStats()
        assert _mlp_rows(model, lambda: forward(model, batch, output, stats)) == [positions] * 2
        assert stats.num_layers == 2


def test_model_trim_last_layer_false_keeps_every_row():
    # model.trim_last_layer: false (build_model sets the decoder's attribute): the layout that
    # a tensor- or context-parallel run is compared with computes every position too.
    model = _text_model("llama")
    batch = _text_batch(packed=True)
    output = output_layer(model)
    positions = batch["tokens"].numel()
    model.trim_last_layer = False
    assert _mlp_rows(model, lambda: forward(model, batch, output)) == [positions, positions]


def test_a_last_layer_drawing_dropout_keeps_every_row():
    # Masks drawn for fewer rows would take other random numbers than the full forward's
    # (and tensor parallelism's): LoRA dropout while training keeps the full path.
    model = _text_model("llama")
    peft.apply_lora(model, LoRAArgs(targets=TARGETS, rank=4, alpha=8.0, dropout=0.1))
    batch = _text_batch(packed=False)
    output = output_layer(model)
    positions = batch["tokens"].numel()
    scored = int((batch["labels"][:, 1:] != IGNORE).sum())
    assert _mlp_rows(model, lambda: forward(model, batch, output)) == [positions, positions]
    model.eval()  # no dropout drawn
    assert _mlp_rows(model, lambda: forward(model, batch, output)) == [positions, scored]


def test_rows_sharing_a_prompt_trim_the_last_layer_too():
    # A GRPO group: one prompt computed once, three completions, one shorter (padding).
    model = _text_model("llama")
    params = _adapt(model, lora=True)
    tokens = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(5))
    tokens[:, :5] = tokens[0, :5]
    labels = tokens.clone()
    labels[:, :5] = IGNORE
    labels[1, -3:] = IGNORE
    batch = {"tokens": tokens, "labels": labels}
    output = output_layer(model)
    scored = int((labels[:, 1:] != IGNORE).sum())
    shared = 5 + 7 + 7 + 4  # the prompt once, then each row's span
    seen = _mlp_rows(model, lambda: forward_sharing_prompts(model, batch, output))
    assert seen == [shared, scored]
    states = forward_sharing_prompts(model, batch, output)
    assert states.shape == (scored, model.args.dim)
    loss_sum, _ = CrossEntropyLoss()(states, labels, output=output)
    full_sum, _ = CrossEntropyLoss()(
        forward(model, {"tokens": tokens}, output), labels, output=output
    )
    loss, full_loss = loss_sum / scored, full_sum / scored
    torch.testing.assert_close(loss, full_loss, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(loss, params)
    for got, want in zip(grads, torch.autograd.grad(full_loss, params), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * max(1.0, want.abs().max()))


def test_sequence_logps_of_scored_rows_weigh_each_row_as_the_full_path():
    model = _text_model("llama")
    params = _adapt(model, lora=True)
    batch = _text_batch(packed=False)
    output = output_layer(model)
    weights = torch.tensor([1.5, -0.25, 3.0])
    results = []
    for given in (batch, {"tokens": batch["tokens"]}):
        logps, lengths, mean_logits = sequence_logps(
            forward(model, given, output), batch["labels"], output=output
        )
        grads = torch.autograd.grad((logps * weights).sum(), params)
        results.append((logps.detach(), lengths, mean_logits, grads))
    (logps, lengths, mean_logits, grads), full = results
    torch.testing.assert_close(logps, full[0], rtol=0, atol=1e-6)
    assert torch.equal(lengths, full[1])
    torch.testing.assert_close(mean_logits, full[2], rtol=0, atol=1e-6)
    for got, want in zip(grads, full[3], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_distillation_takes_scored_rows_of_student_and_teacher():
    generator = torch.Generator().manual_seed(4)
    student = torch.randn(3, 12, 16, generator=generator, requires_grad=True)
    teacher = torch.randn(3, 12, 8, generator=generator)
    labels = _text_batch(packed=False)["labels"]
    rows = scored_rows(labels)
    head = torch.randn(VOCAB, 16, generator=generator)
    teacher_head = torch.randn(VOCAB, 8, generator=generator)
    output = OutputLayer(lambda h: h @ head.T, False, VOCAB)
    teacher_output = OutputLayer(lambda h: h @ teacher_head.T, False, VOCAB)
    loss_fn = ForwardKLLoss(num_chunks=2)
    full = loss_fn(student, teacher, labels, output, teacher_output)
    trimmed_student = student.reshape(-1, 16)[rows]
    trimmed = loss_fn(trimmed_student, teacher.reshape(-1, 8)[rows], labels, output, teacher_output)
    assert trimmed.num_tokens == full.num_tokens == rows.numel()
    torch.testing.assert_close(trimmed.loss_sum, full.loss_sum, rtol=0, atol=1e-6)
    for name, value in full.metrics.items():
        torch.testing.assert_close(trimmed.metrics[name], value, rtol=0, atol=1e-6)
    (got,) = torch.autograd.grad(trimmed.loss_sum, student)
    (want,) = torch.autograd.grad(full.loss_sum, student)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="one row per scored position"):
        loss_fn(trimmed_student[1:], teacher, labels, output, teacher_output)
