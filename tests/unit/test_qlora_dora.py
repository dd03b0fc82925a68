"""NF4 quantization of the base (QLoRA) and DoRA on one process.

NF4 rows quantized with the whole weight's block-scale mean equal torchao's quantization of the
whole weight, bit for bit; DoRA's forward equals its merged weight, with the adapter off it is
the base layer exactly; and saving a step checkpoint or exporting never writes a live weight.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tunelab.config.lora import LoRAArgs
from tunelab.errors import ConfigError
from tunelab.peft import LoRALinear, apply_lora, disable_adapter, merged_state_dict
from tunelab.peft.merge import merge_weight
from tunelab.peft.nf4 import (
    copy_rows_nf4_,
    dequantize,
    frozen_linear_bytes,
    is_nf4,
    quantize_base_nf4,
    quantize_rows_nf4,
)

torchao = pytest.importorskip("torchao")


def _to_nf4(weight):
    from torchao.quantization import to_nf4

    return to_nf4(weight, 64, 256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_nf4_rows_equal_torchao_bit_for_bit(dtype, num_shards):
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)).to(dtype)
    weight[3, 5] = 40.0  # one outlier block, so the scales differ a lot
    whole = _to_nf4(weight)
    absmax = weight.reshape(-1, 64).abs().amax(dim=1)
    for index, rows in enumerate(weight.chunk(num_shards)):
        scalers, factor, data = quantize_rows_nf4(rows, absmax.mean(), whole.nf4)
        assert torch.equal(data, whole.quantized_data.chunk(num_shards)[index])
        assert torch.equal(scalers, whole.quantized_scalers.chunk(num_shards)[index])
        assert torch.equal(factor, whole.quantization_factor.chunk(num_shards)[index])


def _meta_model(**lora):
    with torch.device("meta"):
        model = nn.ModuleDict(
            {
                "embed_tokens": nn.Embedding(10, 256),
                "q_proj": nn.Linear(256, 256, bias=False),
                "k_proj": nn.Linear(256, 128, bias=True),
                "gate": nn.Linear(256, 3, bias=False),
                "lm_head": nn.Linear(256, 128, bias=False),
            }
        )
        apply_lora(model, LoRAArgs(targets=["q_proj"], rank=2, alpha=4.0, **lora))
    return model


def test_quantize_base_nf4_quantizes_frozen_linears_only():
    model = _meta_model(use_dora=True)
    plan = quantize_base_nf4(model, device=torch.device("cpu"), world_size=2)
    assert plan.quantized == ["q_proj", "k_proj"]
    assert plan.kept == {"gate": "3 rows do not split evenly over 2 processes"}
    one = quantize_base_nf4(_meta_model(), device=torch.device("cpu"))
    assert one.kept == {"gate": "3 x 256 values per process are not a multiple of 64 x 256"}
    assert is_nf4(model["q_proj"].weight) and is_nf4(model["k_proj"].weight)
    for frozen in (model["lm_head"].weight, model["embed_tokens"].weight, model["k_proj"].bias):
        assert not is_nf4(frozen)
    for trainable in (model["q_proj"].lora_A.weight, model["q_proj"].lora_magnitude_vector):
        assert not is_nf4(trainable) and trainable.requires_grad
    odd = quantize_base_nf4(_meta_model(), device=torch.device("cpu"), world_size=3)
    assert odd.kept["q_proj"] == "256 rows do not split evenly over 3 processes"
    with pytest.raises(ConfigError, match="q_proj.weight is materialised"):
        quantize_base_nf4(
            nn.ModuleDict({"q_proj": nn.Linear(256, 256).requires_grad_(False)}), device="cpu"
        )


def _loaded(model, state):
    model.to_empty(device="cpu")
    for key, param in model.state_dict(keep_vars=True).items():
        if key in state:
            copy_rows_nf4_(param, state[key])
    torch.manual_seed(1)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.reset_lora_parameters()
    return model


def test_nf4_load_fills_torchao_values_and_counts_bytes():
    torch.manual_seed(0)
    state = {k: v for k, v in _meta_model().to_empty(device="cpu").state_dict().items()}
    state = {k: torch.randn(v.shape) for k, v in state.items() if "lora_" not in k}
    model = _meta_model()
    plain_bytes = frozen_linear_bytes(_loaded(_meta_model(), state))
    quantize_base_nf4(model, device=torch.device("cpu"))
    _loaded(model, state)
    for name in ("q_proj", "k_proj"):
        whole = _to_nf4(state[f"{name}.weight"])
        assert torch.equal(model[name].weight.get_original_weight(), whole.get_original_weight())
    assert torch.equal(model["gate"].weight, state["gate.weight"])
    # q and k in NF4: 0.5 byte per value plus one int8 scale per 64 values and a few
    # factors; gate stays fp32 and lm_head is not counted.
    nf4_bytes = frozen_linear_bytes(model)
    assert plain_bytes == 4 * (256 * 256 + 128 * 256 + 3 * 256)
    assert nf4_bytes == (256 * 256 + 128 * 256) * (1 / 2 + 1 / 64 + 4 / 64 / 256) + 4 * 3 * 256


@pytest.mark.parametrize("quantize", [False, True])
def test_dora_forward_equals_its_merge_and_disabled_is_the_base(quantize):
    torch.manual_seed(0)
    linear = nn.Linear(256, 128, bias=True)
    state = {"weight": linear.weight.detach().clone(), "bias": linear.bias.detach().clone()}
    with torch.device("meta"):
        module = LoRALinear(256, 128, rank=4, alpha=8.0, bias=True, use_dora=True)
    if quantize:
        quantize_base_nf4(nn.ModuleDict({"proj": module}), device=torch.device("cpu"))
    module.to_empty(device="cpu")
    copy_rows_nf4_(module.weight, state["weight"])
    module.bias.detach().copy_(state["bias"])
    torch.manual_seed(1)
    module.reset_lora_parameters()
    weight = dequantize(module.weight)
    assert is_nf4(module.weight) == quantize
    # The magnitude starts at the row norms of W, so a fresh adapter changes nothing.
    assert torch.equal(module.lora_magnitude_vector, torch.linalg.norm(weight, dim=1))
    x = torch.randn(3, 5, 256)
    torch.testing.assert_close(module(x), F.linear(x, weight, module.bias), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        module.lora_B.weight.normal_(0, 0.1)
        module.lora_magnitude_vector.mul_(torch.rand(128) + 0.5)
    merged = merge_weight(
        module.weight, module.lora_A.weight, module.lora_B.weight, 2.0, module.lora_magnitude_vector
    )
    delta = weight + 2.0 * module.lora_B.weight @ module.lora_A.weight
    expected = module.lora_magnitude_vector.unsqueeze(1) * delta / delta.norm(dim=1, keepdim=True)
    torch.testing.assert_close(merged, expected.detach(), rtol=1e-5, atol=1e-6)
    out = module(x)
    torch.testing.assert_close(out, F.linear(x, merged, module.bias), rtol=1e-5, atol=1e-5)
    model = nn.ModuleDict({"proj": module})
    with disable_adapter(model):
        assert torch.equal(module(x), F.linear(x, module.weight, module.bias))
    assert set(merged_state_dict(model)) == {"proj.weight", "proj.bias"}
    # The norm is a constant in backward (DoRA section 4.3): the magnitude's gradient is
    # (x W'^T / m) summed against the output gradient.
    out.sum().backward()
    direction = F.linear(x, merged.detach() / module.lora_magnitude_vector.detach().unsqueeze(1))
    expected_grad = direction.reshape(-1, 128).sum(0)
    torch.testing.assert_close(
        module.lora_magnitude_vector.grad, expected_grad, rtol=1e-4, atol=1e-4
    )


def test_save_and_export_leave_live_weights_unchanged(world_of_one, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tunelab.checkpoint import CheckpointClient
    from tunelab.config.recipe_args import LoRAArgs
    from tunelab.peft import get_adapter_params, lora_target_names
    from tunelab.training import load_model

    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    lora = LoRAArgs(rank=2, alpha=4.0, targets=["q_proj", "down_proj"], use_dora=True)
    lora.quantize_base = "nf4"
    model = load_model(
        str(tmp_path / "base"), device=torch.device("cpu"), dtype=torch.float32, lora=lora
    )
    params = list(get_adapter_params(model).values())
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    loss = model(torch.tensor([[1, 2, 3, 4]])).square().mean()
    loss.backward()
    optimizer.step()

    def snapshot():
        state = {}
        for key, value in model.state_dict().items():
            if is_nf4(value):
                for name in ("quantized_data", "quantized_scalers", "quantization_factor"):
                    state[f"{key}/{name}"] = getattr(value, name).clone()
            else:
                state[key] = value.detach().clone()
        return state

    before = snapshot()
    assert sum(key.endswith("/quantized_data") for key in before) == 7
    client = CheckpointClient(
        tmp_path / "out",
        model=model,
        optimizer=optimizer,
        lr_scheduler=None,
        base_checkpoint_dir=tmp_path / "base",
        lora=LoRAArgs(rank=2, alpha=4.0, targets=lora_target_names(model), use_dora=True),
    )
    client.save(1, 0, {"note": "sync"}, blocking=True)
    client.export(0)
    client.close()
    after = snapshot()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert (tmp_path / "out" / "epoch_0" / "adapter" / "adapter_model.safetensors").is_file()
