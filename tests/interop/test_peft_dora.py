"""tunelab DoRA against peft and transformers on a tiny Llama.

Our DoRA on a transformers LlamaForCausalLM saves a PEFT DoRA adapter (``use_dora: true``,
``lora_magnitude_vector`` keys) that ``PeftModel`` loads with PEFT's exact key set and our
logits; its merge loads in transformers with the same logits; and an adapter PEFT trained
with DoRA loads into ours with PEFT's logits.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from tunelab.config.lora import LoRAArgs  # noqa: E402
from tunelab.peft import (  # noqa: E402
    adapter_state_dict,
    apply_lora,
    get_adapter_params,
    load_peft_adapter,
    merged_state_dict,
    read_adapter_config,
    save_peft_adapter,
)

TOKENS = torch.tensor([[1, 5, 9, 2, 33, 7], [4, 4, 60, 12, 0, 3]])
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def _base(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False, attention_bias=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model):
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def _perturb(named_params):
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in named_params:
            if "lora_B" in name:
                param.normal_(std=0.5)
            elif "lora_magnitude_vector" in name:
                param.mul_(1 + 0.3 * torch.rand_like(param))


def test_our_dora_adapter_and_merge_load_in_peft_and_transformers(tmp_path):
    base_dir = _base(tmp_path)
    ours = _load(base_dir)
    swapped = apply_lora(ours, LoRAArgs(targets=TARGETS, rank=4, alpha=8.0, use_dora=True))
    # A fresh DoRA adapter (B = 0, magnitude = ||W|| per row) leaves the model unchanged.
    torch.testing.assert_close(_logits(ours), _logits(_load(base_dir)), rtol=0, atol=1e-5)
    _perturb(get_adapter_params(ours).items())
    expected = _logits(ours)
    config = LoRAArgs(rank=4, alpha=8.0, dropout=0.0, use_rslora=False, use_dora=True).peft_config(swapped, str(base_dir))  # fmt: skip
    adapter_dir = tmp_path / "adapter"
    save_peft_adapter(adapter_state_dict(ours), config, adapter_dir)
    assert read_adapter_config(adapter_dir)["use_dora"] is True

    peft_model = peft.PeftModel.from_pretrained(_load(base_dir), adapter_dir).eval()
    saved_keys = set(load_file(adapter_dir / "adapter_model.safetensors"))
    assert set(peft.get_peft_model_state_dict(peft_model)) == saved_keys
    assert sum(key.endswith(".lora_magnitude_vector") for key in saved_keys) == len(swapped)
    torch.testing.assert_close(_logits(peft_model), expected, rtol=0, atol=1e-5)

    plain = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(base_dir))
    plain.load_state_dict(merged_state_dict(ours), strict=True)
    torch.testing.assert_close(_logits(plain.eval()), expected, rtol=0, atol=1e-5)


def test_we_read_a_dora_adapter_peft_wrote(tmp_path):
    base_dir = _base(tmp_path)
    lora_config = peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0, use_dora=True,
        task_type="CAUSAL_LM",
    )  # fmt: skip
    peft_model = peft.get_peft_model(_load(base_dir), lora_config)
    _perturb(peft_model.named_parameters())
    peft_model.eval()
    peft_model.save_pretrained(tmp_path / "peft_adapter")

    ours = _load(base_dir)
    apply_lora(ours, LoRAArgs.from_peft_config(read_adapter_config(tmp_path / "peft_adapter")))
    load_peft_adapter(ours, tmp_path / "peft_adapter")
    torch.testing.assert_close(_logits(ours), _logits(peft_model), rtol=0, atol=1e-5)
