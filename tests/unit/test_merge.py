"""The out-of-place LoRA merge on one process."""

import torch
from torch import nn

from tunelab.config.lora import LoRAArgs
from tunelab.peft import (
    LoRALinear,
    apply_lora,
    disable_adapter,
    get_adapter_params,
    merged_state_dict,
)
from tunelab.peft.merge import merge_weight


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(6, 4)
        self.q_proj = nn.Linear(4, 4, bias=True)
        self.down_proj = nn.Linear(4, 4, bias=False)
        self.register_buffer("inv_freq", torch.arange(4.0))


class Tiny(nn.Module):
    def __init__(self, tie=False):
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(4, 6, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens):
        h = self.model.embed_tokens(tokens) + self.model.inv_freq
        h = self.model.down_proj(torch.relu(self.model.q_proj(h)))
        return self.lm_head(h)


def test_merge_weight_hand_checked():
    # W + (alpha/r) B A with W = I, B = [[1], [2]], A = [[3, 4]], scale 0.5:
    # B A = [[3, 4], [6, 8]] -> W' = [[2.5, 2], [3, 5]].
    merged = merge_weight(
        torch.eye(2), torch.tensor([[3.0, 4.0]]), torch.tensor([[1.0], [2.0]]), 0.5
    )
    torch.testing.assert_close(merged, torch.tensor([[2.5, 2.0], [3.0, 5.0]]), rtol=0, atol=0)


def test_merge_is_computed_in_fp32_then_cast_to_bf16():
    # W = 1.0078125 (bf16, odd last mantissa bit); delta = 0.9984 * 2^-8 = 0.0038999...
    # fp32: 1.0117124 is below the bf16 midpoint 1.01171875 -> 1.0078125.
    # All-bf16 would round delta to 2^-8 first, land exactly on the midpoint and round to
    # even: 1.015625. Only the fp32 path gives 1.0078125.
    weight = torch.tensor([[1.0078125]], dtype=torch.bfloat16)
    lora_a = torch.tensor([[2.0**-8]], dtype=torch.bfloat16)
    lora_b = torch.tensor([[1.0]], dtype=torch.bfloat16)
    merged = merge_weight(weight, lora_a, lora_b, 0.9984)
    assert merged.dtype == torch.bfloat16
    assert merged.item() == 1.0078125
    naive = weight + 0.9984 * (lora_b @ lora_a)
    assert naive.item() == 1.015625  # the test's premise: bf16 arithmetic would differ


def _lora_model(tie=False):
    torch.manual_seed(0)
    model = Tiny(tie=tie)
    apply_lora(model, LoRAArgs(targets=["q_proj", "down_proj", "lm_head"], rank=2, alpha=3.0))
    with torch.no_grad():
        for name, param in get_adapter_params(model).items():
            if "lora_B" in name:
                param.normal_()
    return model


def test_merged_state_dict_matches_the_unmerged_forward_and_leaves_the_model_alone():
    model = _lora_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.tensor([[0, 1, 5, 3]])
    expected = model(tokens)

    merged = merged_state_dict(model)
    assert sorted(merged) == [
        "lm_head.weight",
        "model.down_proj.weight",
        "model.embed_tokens.weight",
        "model.inv_freq",
        "model.q_proj.bias",
        "model.q_proj.weight",
    ]
    plain = Tiny()
    plain.load_state_dict(merged, strict=True)
    torch.testing.assert_close(plain(tokens), expected, rtol=1e-6, atol=1e-6)

    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    # Non-LoRA entries are the model's own tensors, not copies; merged ones are new.
    assert merged["model.inv_freq"].data_ptr() == model.model.inv_freq.data_ptr()
    assert merged["model.q_proj.bias"].data_ptr() == model.model.q_proj.bias.data_ptr()
    assert merged["model.q_proj.weight"].data_ptr() != model.model.q_proj.weight.data_ptr()
    with disable_adapter(model):
        assert not torch.allclose(model(tokens), expected)  # the adapter matters here


def test_tied_lm_head_merges_into_its_own_tensor():
    model = _lora_model(tie=True)
    assert isinstance(model.lm_head, LoRALinear)
    embedding_before = model.model.embed_tokens.weight.clone()
    merged = merged_state_dict(model)
    assert torch.equal(merged["model.embed_tokens.weight"], embedding_before)
    lm_head = model.lm_head
    expected = embedding_before + lm_head.scale * (lm_head.lora_B.weight @ lm_head.lora_A.weight)
    torch.testing.assert_close(merged["lm_head.weight"], expected, rtol=0, atol=0)
    assert torch.equal(model.model.embed_tokens.weight, embedding_before)


def test_wrapper_name_components_are_dropped_from_keys():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from tunelab.peft import adapter_state_dict, lora_target_names

    model = _lora_model()
    model.model = checkpoint_wrapper(model.model)
    assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_parameters())
    assert sorted(adapter_state_dict(model))[0] == "lm_head.lora_A.weight"
    assert "model.q_proj.lora_B.weight" in adapter_state_dict(model)
    assert "model.q_proj.lora_B.weight" in get_adapter_params(model)
    assert "model.q_proj.weight" in merged_state_dict(model)
    assert not any("_checkpoint_wrapped_module" in key for key in merged_state_dict(model))
    assert lora_target_names(model) == ["down_proj", "lm_head", "q_proj"]
