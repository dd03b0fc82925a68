"""A real 2-process LoRA run of a tiny Qwen3-MoE, as transformers writes it.

``tiny/moe_lora`` pointed at a random Qwen3-MoE built here (q/k norms, ``norm_topk_prob``, a
dense MLP layer among the MoE ones via ``mlp_only_layers``, the tiny tokenizer): FSDP2 shards
the experts; the run trains LoRA on attention and on the experts with packed rows and the
router term, resumes exactly after a kill, and exports the merged weights (transformers loads
them with no missing key) and an adapter that PEFT applies to the base with the logits of our
merged export (where PEFT loads expert LoRA: peft >= 0.17 on transformers 5).
"""

import pytest

from tests.recipes.moe_runs import (
    MOE_LORA_RUN,
    assert_export_is_the_adapted_base,
    assert_run_resumes_exactly,
    build_tiny_qwen3_moe,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
if not hasattr(transformers, "Qwen3MoeConfig"):
    pytest.skip("this transformers has no Qwen3-MoE", allow_module_level=True)

pytestmark = pytest.mark.slow


def test_two_process_qwen3_moe_lora_resumes_exactly_and_exports(tmp_path):
    base = tmp_path / "base"
    build_tiny_qwen3_moe(base)
    out = assert_run_resumes_exactly(tmp_path, f"model.path={base}", *MOE_LORA_RUN)
    merged = assert_export_is_the_adapted_base(out / "epoch_0", base)
    assert type(merged.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"  # the dense layer
