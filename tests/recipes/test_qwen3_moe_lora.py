"""A real 2-process LoRA run of a tiny Qwen3-MoE, as transformers writes it.

``tiny/moe_lora`` pointed at a random Qwen3-MoE built here (q/k norms, ``norm_topk_prob``, a
dense MLP layer among the MoE ones via ``mlp_only_layers``, the tiny tokenizer): FSDP2 shards
the experts; the run trains LoRA on attention and on the experts with packed rows and the
router term, resumes exactly after a kill, and exports the merged weights (transformers loads
them with no missing key) and an adapter that PEFT applies to the base with the logits of our
merged export (where PEFT loads expert LoRA: peft >= 0.17 on transformers 5).
"""

import json

import pytest
import torch

from tests.recipes.moe_runs import (
    MOE_LORA_RUN,
    assert_export_is_the_adapted_base,
    assert_run_resumes_exactly,
    copy_tiny_tokenizer,
)
from tunelab._paths import assets_dir

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
if not hasattr(transformers, "Qwen3MoeConfig"):
    pytest.skip("this transformers has no Qwen3-MoE", allow_module_level=True)

pytestmark = pytest.mark.slow


def _build(path):
    tiny = json.loads((assets_dir() / "tiny" / "config.json").read_text())
    config = transformers.Qwen3MoeConfig(
        vocab_size=tiny["vocab_size"], hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], bos_token_id=tiny["bos_token_id"],
        eos_token_id=tiny["eos_token_id"], pad_token_id=tiny["pad_token_id"],
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    copy_tiny_tokenizer(path)


def test_two_process_qwen3_moe_lora_resumes_exactly_and_exports(tmp_path):
    base = tmp_path / "base"
    _build(base)
    out = assert_run_resumes_exactly(tmp_path, f"model.path={base}", *MOE_LORA_RUN)
    merged = assert_export_is_the_adapted_base(out / "epoch_0", base)
    assert type(merged.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"  # the dense layer
