"""A real 2-process LoRA run on each new family, its adapter loaded by PEFT.

The tiny family models of tests/conftest.py (window 5, soft-caps, q/k norms, fused Phi-3
projections, partial rotary, LongRoPE) get the embedded tiny tokenizer and train with packed
sequences, so the sliding window and the soft-caps run in the training path under document
masks. The step-1 loss equals transformers' on the same batch. The exported adapter, applied
by PEFT to the transformers model, must give the logits of our merged export loaded by
transformers, which tests the shard-local merge of every weight, the fused ones included.
"""

import shutil

import pytest
import torch

from tests.conftest import build_tiny_hf_model
from tests.recipes.conftest import losses_by_step, tunelab_run
from tests.recipes.independent_loss import sft_step_one_loss
from tunelab._paths import assets_dir

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow
TINY = assets_dir() / "tiny"
# Step 1 against transformers: fp32 kernels summing in another order (soft-caps, windows).
STEP_ONE_TOLERANCE = 1e-5
# Phi-3's fused modules by name, Gemma 3 through all-linear, the others by their HF names.
_LLAMA_NAMES = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
TARGETS = {
    "qwen3": _LLAMA_NAMES,
    "mistral": _LLAMA_NAMES,
    "gemma2": _LLAMA_NAMES,
    "gemma3": "[all-linear]",
    "phi3": "[qkv_proj,o_proj,gate_up_proj,down_proj]",
}


def _family_checkpoint(family: str, path):
    """The tiny family model, sized for the tiny tokenizer, with that tokenizer's files."""
    tokenizer_ids = dict(vocab_size=810, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    build_tiny_hf_model(family, **tokenizer_ids).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY / name, path / name)
    return path


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_two_process_lora_adapter_loads_in_peft_like_our_merged_export(tmp_path, family):
    base = _family_checkpoint(family, tmp_path / "base")
    out = tmp_path / "run"
    tunelab_run(
        "lora_finetune_distributed",
        "tiny/lora",
        f"model.path={base}",
        f"output_dir={out}",
        f"lora.targets={TARGETS[family]}",
        "dataset.packed=true",
        "~val_dataset",
        "schedule.batch_size=2",
        "schedule.epochs=1",
        "schedule.max_steps_per_epoch=2",
        "lr_scheduler.num_warmup_steps=0",
        "checkpoint.save_every_n_steps=null",
        "checkpoint.enable_async_checkpointing=false",
    )
    losses = losses_by_step(out)
    assert sorted(losses) == [1, 2] and all(torch.isfinite(torch.tensor(list(losses.values()))))
    # Step 1 is the base model's forward: transformers (eager attention), each packed document
    # on its own, on the same 4 samples.
    expected = sft_step_one_loss(
        "tiny/lora", f"model.path={base}", "dataset.packed=true", global_batch=4
    )
    assert abs(losses[1] - expected) <= STEP_ONE_TOLERANCE, (losses[1], expected)
    export = out / "epoch_0"
    tokens = torch.randint(0, 810, (2, 17), generator=torch.Generator().manual_seed(0))
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        export, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    adapted = peft.PeftModel.from_pretrained(_hf(base), export / "adapter").eval()
    lora_b = [p for n, p in adapted.named_parameters() if "lora_B" in n]
    assert lora_b and max(float(p.abs().max()) for p in lora_b) > 1e-4  # it trained
    with torch.no_grad():
        expected = merged.eval()(tokens).logits
        assert float((adapted(tokens).logits - expected).abs().max()) <= 1e-4
        # ...and the adapter changed the model.
        assert float((_hf(base)(tokens).logits - expected).abs().max()) > 1e-4
