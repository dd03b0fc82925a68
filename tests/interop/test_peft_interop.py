"""tunelab LoRA against peft and transformers on a tiny Llama.

Our LoRA applied to a transformers LlamaForCausalLM (same module names as tunelab's decoder)
must save an adapter PEFT loads with the identical key set and identical logits, merge into
weights transformers loads as a plain model with the same logits, and read PEFT's own
adapters back.
"""

import json

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


def _tiny_llama(tmp_path, tie):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    base_dir = tmp_path / "base"
    model.save_pretrained(base_dir)
    return base_dir


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model):
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.mark.parametrize(
    ("targets", "tie", "use_rslora"),
    [
        (["q_proj", "k_proj", "v_proj", "o_proj"], False, False),
        ("all-linear", True, True),
        (["v_proj", "down_proj", "lm_head"], False, False),
    ],
)
def test_our_adapter_and_merge_load_in_peft_and_transformers(tmp_path, targets, tie, use_rslora):
    base_dir = _tiny_llama(tmp_path, tie)
    ours = _load(base_dir)
    swapped = apply_lora(ours, LoRAArgs(targets=targets, rank=4, alpha=8.0, use_rslora=use_rslora))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in get_adapter_params(ours).items():
            if "lora_B" in name:
                param.normal_(std=0.5)
    expected = _logits(ours)
    assert not torch.allclose(expected, _logits(_load(base_dir)), atol=1e-3)

    adapter_dir = tmp_path / "epoch_0" / "adapter"
    config = LoRAArgs(rank=4, alpha=8.0, dropout=0.0, use_rslora=use_rslora).peft_config(
        swapped, str(base_dir)
    )
    save_peft_adapter(adapter_state_dict(ours), config, adapter_dir)

    peft_model = peft.PeftModel.from_pretrained(_load(base_dir), adapter_dir).eval()
    # PEFT only warns on missing keys: compare the key sets explicitly. (With lm_head among the
    # targets PEFT would also save the base lm_head weight unless told not to; the base model
    # holds that weight, so the adapter needs only lora_A/lora_B.)
    saved_keys = set(load_file(adapter_dir / "adapter_model.safetensors"))
    assert (
        set(peft.get_peft_model_state_dict(peft_model, save_embedding_layers=False)) == saved_keys
    )
    assert len(saved_keys) == 2 * len(swapped)
    torch.testing.assert_close(_logits(peft_model), expected, rtol=0, atol=1e-5)

    merged_dir = tmp_path / "epoch_0"
    plain = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(base_dir))
    merged = merged_state_dict(ours)
    if tie and "lm_head.weight" in merged:
        assert torch.equal(
            merged["lm_head.weight"], merged["model.embed_tokens.weight"]
        )  # no LoRA on lm_head here
    plain.load_state_dict(merged, strict=True)
    plain.save_pretrained(merged_dir)
    assert not (merged_dir / "adapter_config.json").exists()
    torch.testing.assert_close(_logits(_load(merged_dir)), expected, rtol=0, atol=1e-5)


def test_we_read_an_adapter_peft_wrote(tmp_path):
    base_dir = _tiny_llama(tmp_path, tie=False)
    lora_config = peft.LoraConfig(
        r=4,
        lora_alpha=16,
        target_modules=["q_proj", "up_proj"],
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(2)
    peft_model = peft.get_peft_model(_load(base_dir), lora_config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    peft_model.eval()
    peft_dir = tmp_path / "peft_adapter"
    peft_model.save_pretrained(peft_dir)
    # Our config carries every field PEFT itself writes that matters for loading.
    ours_config = LoRAArgs(rank=4, alpha=16, dropout=0.0, use_rslora=False).peft_config(
        ["q_proj", "up_proj"], None
    )
    theirs = json.loads((peft_dir / "adapter_config.json").read_text())
    assert set(ours_config) <= set(theirs)

    ours = _load(base_dir)
    apply_lora(ours, LoRAArgs.from_peft_config(read_adapter_config(peft_dir)))
    load_peft_adapter(ours, peft_dir)
    torch.testing.assert_close(_logits(ours), _logits(peft_model), rtol=0, atol=1e-5)
