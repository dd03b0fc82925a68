"""LoRAArgs is the one LoRA description: PEFT's adapter_config.json both ways, the fingerprint,
and an adapter_dir reconciled with the lora settings at validation, before any model loads."""

import json

import pytest

from tunelab.cli.main import main
from tunelab.config import load_config, parse_args
from tunelab.config.lora import LoRAArgs, read_adapter_config
from tunelab.config.recipe_args import LoRAFinetuneArgs
from tunelab.errors import CheckpointError, ConfigError


def _adapter(folder, **config):
    folder.mkdir(parents=True)
    written = LoRAArgs(rank=4, alpha=8.0, dropout=0.1, use_rslora=True, **config)
    (folder / "adapter_config.json").write_text(
        json.dumps(written.peft_config(["model.layers.0.self_attn.q_proj", "v_proj"], "/base"))
    )
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_peft_config_round_trips_under_peft_names():
    lora = LoRAArgs(rank=4, alpha=8.0, dropout=0.1, targets=["q_proj", "v_proj"], use_dora=True)
    config = lora.peft_config(["model.layers.0.self_attn.v_proj", "q_proj"], "org/base")
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.1)
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["use_dora"] is True
    assert LoRAArgs.from_peft_config(config, quantize_base="nf4") == LoRAArgs(
        rank=4, alpha=8.0, dropout=0.1, targets=["q_proj", "v_proj"], use_dora=True,
        quantize_base="nf4",
    )  # fmt: skip


def test_fingerprint_records_what_changes_the_adapter_not_dropout():
    plain = LoRAArgs(rank=4, alpha=8.0, dropout=0.0).fingerprint(["v_proj", "q_proj"])
    assert plain == {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"], "use_rslora": False}
    assert LoRAArgs(rank=4, alpha=8.0, dropout=0.3).fingerprint(["q_proj", "v_proj"]) == plain
    qlora = LoRAArgs(rank=4, alpha=8.0, use_dora=True, quantize_base="nf4")
    assert qlora.fingerprint(["q_proj"])["use_dora"] is True
    assert qlora.fingerprint(["q_proj"])["quantize_base"] == "nf4"


def test_an_adapter_fills_the_lora_settings_left_at_their_defaults(tmp_path):
    adapter = _adapter(tmp_path / "adapter")
    lora = LoRAArgs()
    assert lora.reconcile_with_adapter(adapter) == []
    assert (lora.rank, lora.alpha, lora.use_rslora) == (4, 8.0, True)
    assert lora.targets == ["q_proj", "v_proj"]
    assert lora.dropout == 0.0  # the run's own choice: an adapter does not decide it


def test_a_lora_setting_that_contradicts_the_adapter_is_one_problem_naming_both(tmp_path):
    adapter = _adapter(tmp_path / "adapter")
    problems = LoRAArgs(rank=16).reconcile_with_adapter(adapter)
    assert problems == [
        f"key 'lora.rank': 16, but the adapter in {adapter} has r=4: drop lora.rank or make it "
        "equal"
    ]
    assert LoRAArgs(rank=4).reconcile_with_adapter(adapter) == []  # equal: no conflict


def test_validation_reconciles_before_any_model_is_loaded(tmp_path, capsys):
    adapter = _adapter(tmp_path / "adapter")
    same_targets = "lora.targets=[q_proj,v_proj]"  # tiny/lora sets all seven
    cfg = load_config("tiny/lora", [f"adapter_dir={adapter}", same_targets])
    args = parse_args(cfg, LoRAFinetuneArgs)
    assert (args.lora.rank, args.lora.alpha, args.lora.use_rslora) == (4, 8.0, True)
    cfg = load_config("tiny/lora", [f"adapter_dir={adapter}", same_targets, "lora.rank=16"])
    with pytest.raises(ConfigError, match="key 'lora.rank': 16, but the adapter in .* has r=4"):
        parse_args(cfg, LoRAFinetuneArgs)
    # The same through `tunelab validate`: one line, exit 1.
    with pytest.raises(SystemExit) as exited:
        main(["validate", "tiny/lora", f"adapter_dir={adapter}", same_targets, "lora.rank=16"])
    assert exited.value.code == 1
    assert "has r=4" in capsys.readouterr().err
    # A config that sets other targets than the adapter's is the same kind of conflict.
    cfg = load_config("tiny/lora", [f"adapter_dir={adapter}"])
    with pytest.raises(ConfigError, match="key 'lora.targets': .* has target_modules="):
        parse_args(cfg, LoRAFinetuneArgs)


def test_unsupported_peft_options_are_refused(tmp_path):
    adapter = _adapter(tmp_path / "adapter")
    config = read_adapter_config(adapter)
    with pytest.raises(CheckpointError, match="rank_pattern"):
        LoRAArgs.from_peft_config({**config, "rank_pattern": {"q_proj": 8}})
    with pytest.raises(CheckpointError, match="regex"):
        LoRAArgs.from_peft_config({**config, "target_modules": ".*proj"})
