"""The embedded models agree with their own config.json and with the configs that train them.

Issue 38, finding 9: ``assets/tiny_moe`` was stored in bfloat16 (and its config.json said so)
while ``configs/tiny/moe_lora.yaml`` trains it in fp32, so a user loading the base with
transformers' defaults, as the docs' PEFT snippet does, got logits 0.1 away from the merged
export. ``tests/recipes/test_docs_peft_snippets.py`` runs that snippet; this is the cheap check.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from tunelab._paths import assets_dir

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MODELS = ["tiny", "tiny_moe"]
TRAINING_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def stored_dtypes(model_dir: Path) -> set[str]:
    with safe_open(model_dir / "model.safetensors", "pt") as handle:
        return {str(handle.get_slice(key).get_dtype()).lower() for key in handle.keys()}


def training_configs(model: str) -> list[tuple[str, str]]:
    """``(config, dtype)`` of every YAML config that trains the embedded ``model``."""
    found = []
    for path in sorted(CONFIGS.rglob("*.yaml")):
        config = yaml.safe_load(path.read_text()) or {}
        # The model folder and dtype: top-level keys, or a ``model`` section's.
        section = config.get("model") if isinstance(config.get("model"), dict) else {}
        folder = section.get("path", config.get("checkpoint_dir"))
        dtype = section.get("dtype", config.get("dtype"))
        if folder == f"${{assets:{model}}}" and dtype is not None:
            found.append((str(path.relative_to(CONFIGS)), dtype))
    return found


@pytest.mark.parametrize("model", MODELS)
def test_an_embedded_model_is_stored_in_the_dtype_its_config_json_names(model):
    folder = assets_dir() / model
    recorded = json.loads((folder / "config.json").read_text())["dtype"]
    # safetensors names dtypes F32/BF16; torch's names are what config.json records.
    names = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
    assert {names[d] for d in stored_dtypes(folder)} == {recorded}


@pytest.mark.parametrize("model", MODELS)
def test_an_embedded_model_is_stored_in_the_dtype_its_configs_train_in(model):
    recorded = json.loads((assets_dir() / model / "config.json").read_text())["dtype"]
    configs = training_configs(model)
    assert configs, f"no config trains assets/{model}"
    for name, dtype in configs:
        assert TRAINING_DTYPES[dtype] == recorded, (
            f"configs/{name}: dtype {dtype}, {recorded} stored"
        )


def test_the_tiny_moe_values_are_exactly_bfloat16_values():
    # build_tiny_moe rounds through bfloat16 (the values the asset always held), then stores
    # float32: a bfloat16 load of it loses nothing.
    with safe_open(assets_dir() / "tiny_moe" / "model.safetensors", "pt") as handle:
        for key in handle.keys():
            tensor = handle.get_tensor(key)
            assert torch.equal(tensor.to(torch.bfloat16).to(tensor.dtype), tensor), key
