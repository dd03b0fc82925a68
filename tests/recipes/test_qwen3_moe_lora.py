"""A real 2-process LoRA run of a tiny Qwen3-MoE, as transformers writes it.

``tiny/moe_lora`` pointed at a random Qwen3-MoE built here (q/k norms, ``norm_topk_prob``, a
dense MLP layer among the MoE ones via ``mlp_only_layers``, the tiny tokenizer): FSDP2 shards
the experts; the run trains LoRA on attention and on the experts with packed rows and the
router term, resumes exactly after a kill, and exports the merged weights (transformers loads
them with no missing key) and an adapter that PEFT applies to the base with the logits of our
merged export (where PEFT loads expert LoRA: peft >= 0.17 on transformers 5).
"""

import json
import shutil

import pytest
import torch

from tests.recipes.conftest import interrupted_copy, losses_by_step, read_metrics, tunelab_run
from tunelab._paths import assets_dir

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
if not hasattr(transformers, "Qwen3MoeConfig"):
    pytest.skip("this transformers has no Qwen3-MoE", allow_module_level=True)

pytestmark = pytest.mark.slow
_RUN = (
    "dataset.packed=true",
    "~val_dataset",
    "batch_size=2",
    "epochs=1",
    "max_steps_per_epoch=3",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=2",
    "checkpoint.enable_async_checkpointing=false",
    "router_aux_loss_coef=0.01",
    "lora.targets=[q_proj,k_proj,v_proj,o_proj,experts.gate_up_proj,experts.down_proj]",
)
_PEFT_LOADS_EXPERTS = (
    "target_parameters" in getattr(peft.LoraConfig, "__dataclass_fields__", {})
    and int(transformers.__version__.split(".")[0]) >= 5
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


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
    for name in _TOKENIZER_FILES:
        shutil.copy(assets_dir() / "tiny" / name, path / name)


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_two_process_qwen3_moe_lora_resumes_exactly_and_exports(tmp_path):
    base = tmp_path / "base"
    _build(base)
    out = tmp_path / "run"
    run = ("lora_finetune_distributed", "tiny/moe_lora", f"checkpoint_dir={base}", *_RUN)
    tunelab_run(*run, f"output_dir={out}")
    losses = losses_by_step(out)
    assert all(r["router_aux_loss"] > 0 for r in read_metrics(out) if "loss" in r)
    assert sorted(losses) == [1, 2, 3] and all(
        map(torch.isfinite, torch.tensor([*losses.values()]))
    )
    resumed_dir = interrupted_copy(out, tmp_path / "resumed", after_step=2)
    tunelab_run(*run, f"output_dir={resumed_dir}", "checkpoint.resume_from_checkpoint=true")
    resumed = losses_by_step(resumed_dir)
    assert sorted(resumed) == [3] and resumed[3] == losses[3]

    export = out / "epoch_0"
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        export, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(merged.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"  # the dense layer
    tokens = torch.randint(0, 810, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = merged.eval()(tokens).logits
        assert float((_hf(base)(tokens).logits - expected).abs().max()) > 1e-4  # trained
        if _PEFT_LOADS_EXPERTS:  # older PEFT cannot hold expert LoRA: the merge is checked
            adapted = peft.PeftModel.from_pretrained(_hf(base), export / "adapter").eval()
            assert float((adapted(tokens).logits - expected).abs().max()) <= 1e-4
