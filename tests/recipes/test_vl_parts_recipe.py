"""``model.vision_tower`` / ``model.projector`` through the real ``tunelab run`` on 2 processes.

A full fine-tune with the tower frozen leaves its weights bit-identical in the export while the
projector and the language model train; a LoRA run with the tower and projector on ``lora``
saves their adapters beside the language model's; a LoRA run on the tiny Qwen3-VL with both
on ``full`` trains them whole and exports them as PEFT's ``modules_to_save``.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import losses_by_step, tunelab_run
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow
TINY_VL = assets_dir() / "tiny_vl"
SETTINGS = [
    "schedule.epochs=1",
    "schedule.max_steps_per_epoch=2",
    "schedule.batch_size=2",
    "lr_scheduler.num_warmup_steps=0",
]


def _weights(folder):
    weights = {}
    for path in folder.glob("*.safetensors"):
        weights |= load_file(path)
    return weights


def _changed(base, new, prefix):
    keys = [key for key in base if key.startswith(prefix)]
    assert keys, prefix
    return {key for key in keys if not torch.equal(base[key], new[key])}, set(keys)


def test_full_fine_tuning_with_the_tower_frozen(tmp_path):
    out = tmp_path / "full"
    overrides = ["~lora", "model.vision_tower=frozen", "optimizer.lr=1e-3", f"output_dir={out}"]
    tunelab_run("full_finetune_distributed", "tiny/vl_lora", *SETTINGS, *overrides)
    assert sorted(losses_by_step(out)) == [1, 2]
    base, new = _weights(TINY_VL), _weights(out / "epoch_0")
    for prefix in ("visual.patch_embed.", "visual.blocks."):
        changed, _ = _changed(base, new, prefix)
        assert not changed, sorted(changed)[:3]
    for prefix in ("visual.merger.", "model.layers.", "lm_head."):
        changed, keys = _changed(base, new, prefix)
        assert changed == keys, sorted(keys - changed)[:3]


def test_lora_on_the_tower_and_projector(tmp_path):
    out = tmp_path / "lora"
    overrides = ["model.vision_tower=lora", "model.projector=lora", f"output_dir={out}"]
    tunelab_run("lora_finetune_distributed", "tiny/vl_lora", *SETTINGS, *overrides)
    adapter = out / "epoch_0" / "adapter"
    names = set(load_file(adapter / "adapter_model.safetensors"))
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    for part in ("model.visual.blocks.0.attn.qkv", "model.visual.blocks.1.mlp.down_proj",
                 "model.visual.merger.mlp.2", "model.language_model.layers.0.self_attn.q_proj"):  # fmt: skip
        assert f"base_model.model.{part}.lora_B.weight" in names, part
        assert part.removeprefix("model.").removeprefix("language_model.") in targets
    assert not any("patch_embed" in name for name in names)


def test_qwen3_vl_lora_with_the_tower_and_projector_trained_whole(tmp_path):
    """``model.vision_tower: full`` and ``model.projector: full`` in a LoRA run on the tiny
    Qwen3-VL: every tower and merger weight trains beside the adapters, the adapter carries
    them as PEFT's ``modules_to_save``, and PEFT on transformers' base model gives the merged
    export's logits."""
    transformers = pytest.importorskip("transformers", minversion="5")
    peft = pytest.importorskip("peft")
    from tests.interop.vl_checks import TOLERANCE, VLSpec

    base_dir = assets_dir() / "tiny_qwen3_vl"
    out = tmp_path / "qwen3_vl"
    overrides = ["model.vision_tower=full", "model.projector=full", f"output_dir={out}"]
    tunelab_run("lora_finetune_distributed", "tiny/qwen3_vl_lora", *SETTINGS, *overrides)
    export = out / "epoch_0"
    base, new = _weights(base_dir), _weights(export)
    for prefix in ("model.visual.", "model.language_model.layers.0.self_attn.q_proj."):
        changed, keys = _changed(base, new, prefix)
        assert changed == keys, sorted(keys - changed)[:3]
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == [
        "visual.patch_embed", "visual.pos_embed", "visual.blocks.0", "visual.blocks.1",
        "visual.merger", "visual.deepstack_merger_list.0",
    ]  # fmt: skip
    model_config = json.loads((base_dir / "config.json").read_text())
    spec = VLSpec(
        transformers.Qwen3VLForConditionalGeneration,
        model_config["image_token_id"],
        model_config["vision_start_token_id"],
        model_config["vision_end_token_id"],
        patch=16,
    )
    grids = [(1, 4, 6)]
    tokens = torch.tensor([spec.row(grids)])
    inputs = spec.hf_inputs(tokens, spec.images(grids))
    adapted = peft.PeftModel.from_pretrained(spec.load_hf(base_dir), export / "adapter").eval()
    with torch.no_grad():
        merged = spec.load_hf(export)(**inputs).logits
        assert float((adapted(**inputs).logits - merged).abs().max()) <= TOLERANCE
        assert float((spec.load_hf(base_dir)(**inputs).logits - merged).abs().max()) > 1e-3
