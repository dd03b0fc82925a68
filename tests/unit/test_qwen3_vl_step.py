"""The Qwen3-VL training step's cheaper passes (issue 44's bench): same results, less work.

* The vision MLPs' ``gelu_pytorch_tanh`` (Qwen3-VL's tower, Gemma 3's SigLIP) runs as
  ``x * sigmoid(2u)`` in place on CPU fp32 without autograd (``gelu_tanh``): equal to
  ``F.gelu(approximate="tanh")`` within fp32 rounding, the input untouched; with autograd, in
  bf16, it is ``F.gelu`` itself.
* Deepstack features are added with one ``index_add`` (no boolean gather, no
  ``masked_scatter`` in the graph), the frozen tower records no graph, and the LoRA step's
  loss and gradients equal those of the boolean-mask formulation.
"""

import torch
import torch.nn.functional as F

import tunelab.peft as peft
from tunelab._paths import assets_dir
from tunelab.config.lora import LoRAArgs
from tunelab.data import image_chat_dataset, load_tokenizer, sft_collate
from tunelab.losses import CrossEntropyLoss
from tunelab.models import load_pretrained, vision_language
from tunelab.modules.feed_forward import gelu_tanh
from tunelab.modules.vision_qwen3 import VisionMLP
from tunelab.modules.vision_siglip import SiglipMLP
from tunelab.training import output_layer
from tunelab.training.loop import forward

TINY_QWEN3_VL = assets_dir() / "tiny_qwen3_vl"


def _inputs() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.cat((torch.linspace(-30, 30, 20001), 3 * torch.randn(20000)))


def test_gelu_tanh_equals_torchs_within_fp32_rounding():
    x = _inputs()
    before = x.clone()
    ours = gelu_tanh(x)
    torch.testing.assert_close(ours, F.gelu(x, approximate="tanh"), rtol=1e-6, atol=1e-6)
    assert torch.equal(x, before)
    # Not F.gelu's own kernel: the in-place sigmoid form (this is what the frozen tower runs).
    assert not torch.equal(ours, F.gelu(x, approximate="tanh"))


def test_gelu_tanh_is_torchs_with_autograd_and_in_bf16():
    x = _inputs().requires_grad_()
    ours = gelu_tanh(x)
    assert torch.equal(ours, F.gelu(x, approximate="tanh"))
    ours.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    half = _inputs().bfloat16()
    assert torch.equal(gelu_tanh(half), F.gelu(half, approximate="tanh"))


def test_the_towers_mlps_run_gelu_tanh_for_the_hub_activation():
    assert VisionMLP(8, 16, "gelu_pytorch_tanh").activation is gelu_tanh
    assert SiglipMLP(8, 16, "gelu_pytorch_tanh").activation is gelu_tanh  # Gemma 3's tower
    assert VisionMLP(8, 16, "silu").activation is F.silu


def _masked_deepstack(h, is_visual, visual_index, features, rows):
    """The boolean-mask formulation the step used before (no ``rows``)."""
    assert rows is None
    return h.masked_scatter(is_visual[..., None], h[is_visual] + features.to(h.dtype))


def _graph_nodes(tensor: torch.Tensor) -> list[str]:
    seen, stack, names = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_deepstack_adds_by_index_and_equals_the_masked_scatter_step(tmp_path, monkeypatch):
    tokenizer = load_tokenizer(TINY_QWEN3_VL, max_seq_len=256)
    rows = image_chat_dataset(
        tokenizer, source="json", data_files=str(assets_dir() / "tiny_vl" / "chat.jsonl"),
        max_seq_len=256, num_proc=1, cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    batch = sft_collate(tokenizer)([rows[i] for i in range(3)], pad_id=tokenizer.pad_id)
    torch.manual_seed(0)
    model = load_pretrained(TINY_QWEN3_VL, device=torch.device("cpu"), dtype=torch.float32)
    peft.apply_lora(model, LoRAArgs(rank=2, alpha=4.0, targets=["q_proj", "v_proj", "down_proj"]))
    adapters = list(peft.get_adapter_params(model).values())
    with torch.no_grad():  # B starts at zero: give the adapters a gradient path through A
        for name, param in peft.get_adapter_params(model).items():
            if "lora_b" in name.lower():
                param.normal_(0, 0.1)
    deepstack_layers = len(model.args.vision.deepstack_blocks)
    assert deepstack_layers >= 1
    # The frozen tower records no graph.
    features, deepstack = model.visual(batch["pixel_values"], batch["image_grid_thw"])
    assert features.grad_fn is None and all(part.grad_fn is None for part in deepstack)

    output, loss_fn = output_layer(model), CrossEntropyLoss()
    hidden = {}

    def step() -> tuple[torch.Tensor, list[torch.Tensor], list[str]]:
        handle = model.model.norm.register_forward_hook(
            lambda module, args, out: hidden.__setitem__("h", args[0])
        )
        try:
            loss, _ = loss_fn(forward(model, batch, output), batch["labels"], output=output)
        finally:
            handle.remove()
        nodes = _graph_nodes(hidden["h"])
        loss.backward()
        grads = [param.grad.clone() for param in adapters]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads, nodes

    loss, grads, nodes = step()
    assert "MaskedScatterBackward0" not in nodes
    assert nodes.count("IndexAddBackward0") == deepstack_layers
    monkeypatch.setattr(vision_language, "_add_deepstack", _masked_deepstack)
    masked_loss, masked_grads, masked_nodes = step()
    assert "MaskedScatterBackward0" in masked_nodes
    torch.testing.assert_close(loss, masked_loss, rtol=0, atol=1e-6)
    for ours, theirs in zip(grads, masked_grads, strict=True):
        assert ours.abs().sum() > 0
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
