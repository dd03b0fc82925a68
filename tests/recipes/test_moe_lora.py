"""A real 2-process LoRA run of ``tiny/moe_lora`` (a Mixtral upcycled from the tiny Llama).

FSDP2 shards the stacked experts over the ranks; the run trains LoRA on attention and on the
stacked expert weights with packed rows, saves, resumes exactly after a kill, and exports: the
merged weights (the expert updates merged shard by shard) in the hub's per-expert layout, which
transformers loads with no missing key, and an adapter that PEFT applies to the transformers
base with the logits of our merged export (where PEFT loads expert LoRA: peft >= 0.17 on
transformers 5).
"""

import pytest
import torch
from safetensors import safe_open

from tests.recipes.conftest import interrupted_copy, losses_by_step, read_metrics, tunelab_run
from tunelab._paths import assets_dir

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

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
    "router_aux_loss_coef=0.01",  # the router terms in the objective, resumed exactly too
    "router_z_loss_coef=0.001",
    "lora.targets=[q_proj,k_proj,v_proj,o_proj,experts.gate_up_proj,experts.down_proj]",
)
_PEFT_LOADS_EXPERTS = (
    "target_parameters" in getattr(peft.LoraConfig, "__dataclass_fields__", {})
    and int(transformers.__version__.split(".")[0]) >= 5
)


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_two_process_moe_lora_resumes_exactly_and_exports_the_hub_layout(tmp_path):
    out = tmp_path / "run"
    tunelab_run("lora_finetune_distributed", "tiny/moe_lora", f"output_dir={out}", *_RUN)
    losses = losses_by_step(out)
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert all(r["router_aux_loss"] > 0 and r["router_z_loss"] > 0 for r in rows)
    assert sorted(losses) == [1, 2, 3] and all(
        map(torch.isfinite, torch.tensor([*losses.values()]))
    )
    resumed_dir = interrupted_copy(out, tmp_path / "resumed", after_step=2)
    tunelab_run(
        "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={resumed_dir}", *_RUN,
        "checkpoint.resume_from_checkpoint=true",
    )  # fmt: skip
    resumed = losses_by_step(resumed_dir)
    assert sorted(resumed) == [3] and resumed[3] == losses[3]

    export = out / "epoch_0"
    with safe_open(export / "model.safetensors", "pt") as f:
        assert "model.layers.2.block_sparse_moe.experts.3.w2.weight" in set(f.keys())
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        export, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with safe_open(export / "adapter" / "adapter_model.safetensors", "pt") as f:
        adapter_keys = set(f.keys())
    assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight" in adapter_keys
    base = assets_dir() / "tiny_moe"
    tokens = torch.randint(0, 810, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = merged.eval()(tokens).logits
        assert float((_hf(base)(tokens).logits - expected).abs().max()) > 1e-4
        if _PEFT_LOADS_EXPERTS:  # older PEFT cannot hold expert LoRA: the merge is checked
            adapted = peft.PeftModel.from_pretrained(_hf(base), export / "adapter").eval()
            assert float((adapted(tokens).logits - expected).abs().max()) <= 1e-4
