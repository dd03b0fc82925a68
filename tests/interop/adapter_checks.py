"""Checks shared by the MoE and gpt-oss interop tests: our LoRA adapter in PEFT, our merged
export in transformers."""

from pathlib import Path

import torch
from safetensors.torch import load_file

from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.config.lora import LoRAArgs
from tunelab.peft import (
    adapter_state_dict,
    get_adapter_params,
    merged_state_dict,
    save_peft_adapter,
)


def hf_model(path: Path) -> torch.nn.Module:
    """transformers' model of ``path`` in fp32 with eager attention, in eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def randomize_lora_b(model: torch.nn.Module, seed: int = 1) -> None:
    """Random ``lora_B`` factors (a fresh adapter's are zero and would change nothing)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in get_adapter_params(model).items():
            if "lora_B" in name:
                param.normal_(std=0.2)


def assert_adapter_and_merge_give_our_logits(
    model: torch.nn.Module,
    swapped: list[str],
    path: Path,
    out: Path,
    tokens: torch.Tensor,
    tolerance: float,
) -> None:
    """With random ``B``: PEFT applies our adapter (same keys) and transformers loads our merged
    export, both with our model's logits, which the base model's are not."""
    import peft

    randomize_lora_b(model)
    with torch.no_grad():
        expected = model(tokens)
    lora = LoRAArgs(rank=8, alpha=16.0, dropout=0.0, use_rslora=False)
    save_peft_adapter(
        adapter_state_dict(model), lora.peft_config(swapped, str(path)), out / "adapter"
    )
    adapted = peft.PeftModel.from_pretrained(hf_model(path), out / "adapter").eval()
    ours = set(load_file(out / "adapter" / "adapter_model.safetensors"))
    assert len(ours) == 2 * len(swapped)
    assert set(peft.get_peft_model_state_dict(adapted)) == ours
    merged = model.state_dict_adapter.to_hf(merged_state_dict(model))
    save_hf_sharded(merged, out / "merged", source_dir=path)
    with torch.no_grad():
        assert float((adapted(tokens).logits - expected).abs().max()) <= tolerance
        assert float((hf_model(out / "merged")(tokens).logits - expected).abs().max()) <= tolerance
        assert float((hf_model(path)(tokens).logits - expected).abs().max()) > 1e-2
