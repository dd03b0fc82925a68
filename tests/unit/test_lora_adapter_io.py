"""Adapter state dicts in PEFT names, adapter_config.json, and the adapter folder I/O."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from torch import nn

from tunelab.config.lora import LoRAArgs
from tunelab.errors import CheckpointError, ConfigError, TunelabError
from tunelab.formats.integrity import verify_folder
from tunelab.peft import (
    adapter_state_dict,
    apply_lora,
    load_peft_adapter,
    read_adapter_config,
    save_peft_adapter,
)
from tunelab.peft.state import from_peft_state_dict, to_peft_state_dict


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(4, 3, bias=False)
        self.v_proj = nn.Linear(4, 2, bias=False)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer()])


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(4, 5, bias=False)


def _lora_model(rank=2, alpha=4.0, seed=0):
    torch.manual_seed(seed)
    model = Tiny()
    targets = apply_lora(model, LoRAArgs(targets=["q_proj", "v_proj"], rank=rank, alpha=alpha))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    return model, targets


def _config(targets, rank=2, alpha=4.0):
    return LoRAArgs(rank=rank, alpha=alpha, dropout=0.0, use_rslora=False).peft_config(
        targets, "/base"
    )


def test_adapter_state_dict_and_peft_names():
    model, _ = _lora_model()
    state = adapter_state_dict(model)
    assert sorted(state) == [
        "model.layers.0.self_attn.q_proj.lora_A.weight",
        "model.layers.0.self_attn.q_proj.lora_B.weight",
        "model.layers.0.self_attn.v_proj.lora_A.weight",
        "model.layers.0.self_attn.v_proj.lora_B.weight",
    ]
    peft = to_peft_state_dict(state)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in peft
    assert from_peft_state_dict(peft).keys() == state.keys()
    with pytest.raises(TunelabError, match="not a LoRA adapter weight"):
        to_peft_state_dict({"lm_head.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="not a PEFT LoRA weight"):
        from_peft_state_dict({"model.q_proj.lora_A.weight": torch.zeros(1)})


def test_adapter_config_fields():
    _, targets = _lora_model()
    config = _config(targets)
    assert config["target_modules"] == ["q_proj", "v_proj"]
    expected = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 2,
        "lora_alpha": 4.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "init_lora_weights": True,
        "base_model_name_or_path": "/base",
    }
    assert {key: config[key] for key in expected} == expected
    parsed = LoRAArgs.from_peft_config(config)
    fields = ("targets", "rank", "alpha", "dropout", "use_rslora", "use_dora")
    assert {key: getattr(parsed, key) for key in fields} == {
        "targets": ["q_proj", "v_proj"],
        "rank": 2,
        "alpha": 4.0,
        "dropout": 0.0,
        "use_rslora": False,
        "use_dora": False,
    }
    assert LoRAArgs.from_peft_config({**config, "use_dora": True}).use_dora is True
    with pytest.raises(ConfigError, match="resolved module names"):
        _config("all-linear")
    with pytest.raises(CheckpointError, match="rank_pattern"):
        LoRAArgs.from_peft_config({**config, "rank_pattern": {"q_proj": 4}})


def test_save_then_load_round_trip(tmp_path):
    model, targets = _lora_model(seed=0)
    out = save_peft_adapter(adapter_state_dict(model), _config(targets), tmp_path / "adapter")
    assert sorted(os.listdir(out)) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tunelab_manifest.json",
    ]
    # The adapter's own manifest: both files with checksums taken as they were written.
    assert verify_folder(out) == []
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight" in set(f.keys())
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 2

    fresh = Tiny()
    apply_lora(fresh, LoRAArgs.from_peft_config(read_adapter_config(out)))
    load_peft_adapter(fresh, out)
    for key, value in adapter_state_dict(model).items():
        assert torch.equal(adapter_state_dict(fresh)[key], value), key


def test_save_replaces_an_existing_adapter_whole(tmp_path):
    model, targets = _lora_model(seed=0)
    target = tmp_path / "adapter"
    save_peft_adapter(adapter_state_dict(model), _config(targets), target)
    other, _ = _lora_model(seed=1)
    save_peft_adapter(adapter_state_dict(other), _config(targets), target)
    assert sorted(os.listdir(tmp_path)) == ["adapter"]  # no temp or retired folders left
    loaded = Tiny()
    apply_lora(loaded, LoRAArgs(targets=targets, rank=2, alpha=4.0))
    load_peft_adapter(loaded, target)
    key = "model.layers.0.self_attn.q_proj.lora_B.weight"
    assert torch.equal(adapter_state_dict(loaded)[key], adapter_state_dict(other)[key])


def test_failed_save_leaves_the_old_adapter_intact(tmp_path):
    model, targets = _lora_model(seed=0)
    target = tmp_path / "adapter"
    save_peft_adapter(adapter_state_dict(model), _config(targets), target)
    before = {name: (target / name).read_bytes() for name in os.listdir(target)}
    bad_config = {**_config(targets), "not_json": object()}  # json.dumps fails mid-save
    with pytest.raises(TypeError):
        save_peft_adapter(adapter_state_dict(model), bad_config, target)
    assert {name: (target / name).read_bytes() for name in os.listdir(target)} == before
    assert sorted(os.listdir(tmp_path)) == ["adapter"]


def test_save_refuses_a_folder_with_model_files(tmp_path):
    model, targets = _lora_model()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"holds model files \(config.json\)"):
        save_peft_adapter(adapter_state_dict(model), _config(targets), tmp_path)


def test_load_errors_name_the_problem(tmp_path):
    model, targets = _lora_model(rank=2)
    out = save_peft_adapter(adapter_state_dict(model), _config(targets), tmp_path / "adapter")

    wrong_rank = Tiny()
    apply_lora(wrong_rank, LoRAArgs(targets=targets, rank=3, alpha=4.0))
    with pytest.raises(
        CheckpointError,
        match=r"\(r, lora_alpha, use_rslora, use_dora\)=\(2, 4.0, False, False\).*\(3, 4.0, False, False\)",
    ):
        load_peft_adapter(wrong_rank, out)

    fewer = Tiny()
    apply_lora(fewer, LoRAArgs(targets=["q_proj"], rank=2, alpha=4.0))
    with pytest.raises(
        CheckpointError, match=r"unexpected \['model.layers.0.self_attn.v_proj.lora_A.weight'"
    ):
        load_peft_adapter(fewer, out)

    more = Tiny()
    apply_lora(more, LoRAArgs(targets=["q_proj", "v_proj", "lm_head"], rank=2, alpha=4.0))
    with pytest.raises(
        CheckpointError, match=r"missing \['lm_head.lora_A.weight', 'lm_head.lora_B.weight'\]"
    ):
        load_peft_adapter(more, out)

    (out / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no adapter_model.safetensors"):
        load_peft_adapter(fewer, out)
    with pytest.raises(CheckpointError, match="no adapter_config.json"):
        read_adapter_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(CheckpointError, match="peft_type must be 'LORA', got 'IA3'"):
        read_adapter_config(tmp_path)
