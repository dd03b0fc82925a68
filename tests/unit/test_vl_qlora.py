"""QLoRA on a vision-language model: NF4 covers the language model only, and it trains.

The tiny Qwen3-VL with its language model widened (hidden 128, 8 heads of 16, MLP 256) so that
its projections hold whole NF4 scale blocks (rows x columns a multiple of 64 x 256 = 16384)
as the mergers' ``linear_fc1`` (128 x 128) and ``linear_fc2`` (128 x 128) do too: every
frozen language-model projection of that size becomes NF4, no tower or projector weight does,
whether the tower and projector are frozen, adapted or trained whole, and a few optimizer
steps on real image rows lower the loss with the NF4 weights unchanged.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tunelab._paths import assets_dir
from tunelab.config.lora import LoRAArgs
from tunelab.config.sections import LoRASFTModelSetupArgs
from tunelab.data import image_chat_dataset, load_tokenizer, sft_collate
from tunelab.losses import CrossEntropyLoss
from tunelab.models import from_hf_config
from tunelab.peft.apply import lora_modules
from tunelab.peft.nf4 import NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE, dequantize, is_nf4
from tunelab.training import adamw, batch_loss, build_model, output_layer

pytest.importorskip("torchao")
CPU = torch.device("cpu")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Sized for NF4 (128 x 128, 256 x 128, 128 x 256); k_proj and v_proj (32 x 128) are not.
LANGUAGE_NF4 = {
    f"model.layers.{layer}.{name}.weight"
    for layer in range(2)
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj")
}  # fmt: skip


@pytest.fixture(scope="module")
def wide_qwen3_vl(tmp_path_factory):
    """A random tiny Qwen3-VL whose language model is wide enough for NF4, in the hub layout."""
    folder = tmp_path_factory.mktemp("wide_qwen3_vl")
    source = assets_dir() / "tiny_qwen3_vl"
    for path in source.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, folder / path.name)
    config = json.loads((source / "config.json").read_text())
    config["text_config"].update(hidden_size=128, num_attention_heads=8, intermediate_size=256)
    config["vision_config"]["out_hidden_size"] = 128
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = from_hf_config(folder)
    state = model.state_dict_adapter.to_hf(model.state_dict())
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    return folder


def _build(folder, tower, projector):
    section = LoRASFTModelSetupArgs(path=str(folder), vision_tower=tower, projector=projector)
    lora = LoRAArgs(rank=4, alpha=8.0, targets=TARGETS, quantize_base="nf4")
    return build_model(section, device=CPU, lora=lora)


def _image_batch(folder, tmp_path):
    tokenizer = load_tokenizer(folder, max_seq_len=128)
    dataset = image_chat_dataset(
        tokenizer, source="json", data_files=str(assets_dir() / "tiny_vl" / "chat.jsonl"),
        cache_dir=str(tmp_path / "cache"), num_proc=1,
    )  # fmt: skip
    return sft_collate(tokenizer)([dataset[i] for i in range(4)], pad_id=tokenizer.pad_id)


@pytest.mark.parametrize(
    ("tower", "projector"), [("frozen", "frozen"), ("lora", "lora"), ("full", "frozen")]
)
def test_qlora_quantizes_the_language_model_only_and_trains(
    wide_qwen3_vl, tmp_path, tower, projector
):
    model = _build(wide_qwen3_vl, tower, projector)
    nf4 = {name for name, param in model.named_parameters() if is_nf4(param)}
    assert nf4 == LANGUAGE_NF4
    # The rule, not the size, keeps the mergers out: their first layer holds whole blocks.
    fc1 = model.visual.merger.linear_fc1.weight
    assert fc1.numel() % (NF4_BLOCK_SIZE * NF4_SCALER_BLOCK_SIZE) == 0 and not is_nf4(fc1)
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.float32 for n, p in params.items() if n.startswith("visual."))
    # The tower's and projector's own weights (their adapters are checked with the others').
    vision = {n: p for n, p in params.items() if n.startswith("visual.") and ".lora_" not in n}
    adapted_vision = {name for name in lora_modules(model) if name.startswith("visual.")}
    assert bool(adapted_vision) == (tower == "lora")

    batch = _image_batch(wide_qwen3_vl, tmp_path)
    assert "pixel_values" in batch
    nf4_before = {name: dequantize(param).clone() for name, param in model.named_parameters()
                  if is_nf4(param)}  # fmt: skip
    vision_before = {name: param.detach().clone() for name, param in vision.items()}
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer = adamw(trainable, lr=1e-2, weight_decay=0.0)
    output, loss_fn = output_layer(model), CrossEntropyLoss()
    losses = []
    for _ in range(4):
        loss_sum, num_tokens = batch_loss(loss_fn, model, batch, output)
        loss = loss_sum / num_tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1, losses
    for name, param in model.named_parameters():
        if is_nf4(param):
            assert torch.equal(dequantize(param), nf4_before[name]), name
    trained = {
        name for name, param in vision.items() if not torch.equal(param, vision_before[name])
    }
    if tower == "full":
        projector = ("visual.merger.", "visual.deepstack_merger_list.")
        assert trained == {name for name in vision if not name.startswith(projector)}
    else:
        assert not trained  # frozen, or adapted: the base weights stay as loaded
    for name, module in lora_modules(model).items():
        assert bool(module.lora_B.weight.abs().sum() > 0), name
