"""What the 2-process MoE LoRA recipe tests share: the run, its exact resume, its export checks.

Each family's test (``test_moe_lora.py``: the embedded tiny Mixtral; ``test_gpt_oss_lora.py``;
``test_qwen3_moe_lora.py``) points ``tiny/moe_lora`` at its tiny model and checks the same
things; only what is particular to the family stays in its file.
"""

import shutil
from pathlib import Path

import torch

from tests.recipes.conftest import interrupted_copy, losses_by_step, read_metrics, tunelab_run
from tunelab._paths import assets_dir

MOE_LORA_RUN = (
    "dataset.packed=true",
    "~val_dataset",
    "schedule.batch_size=2",
    "schedule.epochs=1",
    "schedule.max_steps_per_epoch=3",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=2",
    "checkpoint.enable_async_checkpointing=false",
    "router.aux_loss_coef=0.01",  # the router term in the objective, resumed exactly too
    "lora.targets=[q_proj,k_proj,v_proj,o_proj,experts.gate_up_proj,experts.down_proj]",
)
"""Overrides of ``tiny/moe_lora``: 3 packed steps, a checkpoint at step 2, LoRA on the experts."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def peft_loads_experts() -> bool:
    """Whether PEFT can hold expert LoRA (``target_parameters``: peft >= 0.17, transformers 5)."""
    import peft
    import transformers

    return (
        "target_parameters" in getattr(peft.LoraConfig, "__dataclass_fields__", {})
        and int(transformers.__version__.split(".")[0]) >= 5
    )


def hf_eager(path: Path):
    """The transformers model at ``path`` in fp32, eager attention, in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def copy_tiny_tokenizer(path: Path) -> None:
    """Put the embedded tiny tokenizer's files into the model folder ``path``."""
    for name in _TOKENIZER_FILES:
        shutil.copy(assets_dir() / "tiny" / name, path / name)


def build_tiny_qwen3_moe(path: Path, **sizes) -> None:
    """Save a random tiny Qwen3-MoE at ``path`` as transformers writes it, with the tiny
    tokenizer: q/k norms, ``norm_topk_prob``, 4 experts (top-2), and a dense MLP layer among
    the MoE ones (``mlp_only_layers``). ``sizes``: ``Qwen3MoeConfig`` fields to change."""
    import json

    import transformers

    tiny = json.loads((assets_dir() / "tiny" / "config.json").read_text())
    fields = dict(
        vocab_size=tiny["vocab_size"], hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], bos_token_id=tiny["bos_token_id"],
        eos_token_id=tiny["eos_token_id"], pad_token_id=tiny["pad_token_id"],
        tie_word_embeddings=False,
    )  # fmt: skip
    config = transformers.Qwen3MoeConfig(**(fields | sizes))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    copy_tiny_tokenizer(path)


def assert_run_resumes_exactly(tmp_path: Path, *overrides: str) -> Path:
    """Run ``tiny/moe_lora`` with ``overrides`` on 2 processes; kill after step 2; resume.

    Asserts the router term was in every step, the three losses are finite, and the resumed
    run's step-3 loss equals the uninterrupted one bit for bit.

    Returns:
        The uninterrupted run's output folder.
    """
    run = ("lora_finetune_distributed", "tiny/moe_lora", *overrides)
    out = tmp_path / "run"
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
    return out


def assert_export_is_the_adapted_base(export: Path, base: Path):
    """transformers loads the merged ``export`` with no missing or unexpected key; it differs
    from ``base`` (trained), and PEFT's adapter on ``base`` gives its logits (1e-4) where PEFT
    can hold expert LoRA.

    Returns:
        The merged model (transformers, eval mode).
    """
    import peft
    import transformers

    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        export, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokens = torch.randint(0, 810, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = merged.eval()(tokens).logits
        assert float((hf_eager(base)(tokens).logits - expected).abs().max()) > 1e-4
        if peft_loads_experts():  # older PEFT cannot hold expert LoRA: the merge is checked
            adapted = peft.PeftModel.from_pretrained(hf_eager(base), export / "adapter").eval()
            assert float((adapted(tokens).logits - expected).abs().max()) <= 1e-4
    return merged
