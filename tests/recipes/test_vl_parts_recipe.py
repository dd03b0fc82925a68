"""``model.vision_tower`` / ``model.projector`` through the real ``tunelab run`` on 2 processes.

A full fine-tune with the tower frozen leaves its weights bit-identical in the export while the
projector and the language model train; a LoRA run with the tower and projector on ``lora``
saves their adapters beside the language model's. (Both on ``full`` in a LoRA run: the Qwen3-VL
runs of ``test_vl_recipe.py``.)
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
