"""A real 2-process LoRA run of a tiny gpt-oss whose experts are MXFP4, as on the hub.

``tiny/moe_lora`` pointed at a random gpt-oss built here (sinks, biases, alternating windows
shorter than the packed rows, YaRN, the tiny tokenizer): FSDP2 shards the experts, each rank
dequantizing only its own; the run trains LoRA on attention and on the experts
(``[E, in, out]`` weights) with packed rows and the router term, resumes exactly after a kill,
and exports the merged weights dequantized in the hub's layout (transformers loads them with no
missing key) and an adapter that PEFT applies to the base with the logits of our merged export
(where PEFT loads expert LoRA: peft >= 0.17 on transformers 5).
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.mxfp4_codes import mxfp4_codes
from tests.recipes.moe_runs import (
    MOE_LORA_RUN,
    assert_export_is_the_adapted_base,
    assert_run_resumes_exactly,
    copy_tiny_tokenizer,
)
from tunelab._paths import assets_dir

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
if not hasattr(transformers, "GptOssConfig"):
    pytest.skip("this transformers has no gpt-oss", allow_module_level=True)

pytestmark = pytest.mark.slow


def _build(plain, quantized):
    tiny = json.loads((assets_dir() / "tiny" / "config.json").read_text())
    config = transformers.GptOssConfig(
        vocab_size=tiny["vocab_size"], hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        bos_token_id=tiny["bos_token_id"], eos_token_id=tiny["eos_token_id"],
        pad_token_id=tiny["pad_token_id"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(2)
    packed = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 1.0)
            elif name.endswith(("gate_up_proj", "down_proj")):
                experts, inputs, outputs = param.shape
                blocks, scales, weight = mxfp4_codes((experts, outputs, inputs), generator)
                param.copy_(weight.transpose(1, 2))
                packed[name] = (blocks, scales)
    model.save_pretrained(plain)
    tensors = load_file(plain / "model.safetensors")
    for key, (blocks, scales) in packed.items():
        del tensors[key]
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    quantized.mkdir()
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    hf_config = json.loads((plain / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (quantized / "config.json").write_text(json.dumps(hf_config))
    copy_tiny_tokenizer(quantized)


def test_two_process_gpt_oss_lora_from_mxfp4_resumes_exactly_and_exports(tmp_path):
    plain, base = tmp_path / "plain", tmp_path / "base"
    _build(plain, base)
    out = assert_run_resumes_exactly(tmp_path, f"model.path={base}", *MOE_LORA_RUN)
    export = out / "epoch_0"
    with safe_open(export / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.down_proj" in keys and not any("_blocks" in k for k in keys)
    assert "quantization_config" not in json.loads((export / "config.json").read_text())
    with safe_open(export / "adapter" / "adapter_model.safetensors", "pt") as f:
        adapter_keys = set(f.keys())
    assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight" in adapter_keys
    assert_export_is_the_adapted_base(export, plain)
