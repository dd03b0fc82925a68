"""The merged rollout weights live no longer than the rollout (issue 40, item 4).

The built-in engine generates with each LoRA layer merged into a temporary copy of its weight
(``tunelab.peft.merged_adapters``): one more copy of the adapted weights, which must be gone
when ``generate`` returns, so that the update pass (the peak of a GRPO step at realistic
shapes, bench/bench_grpo.py) never holds it beside the LoRA base. A reference kept anywhere
(the layer, the engine, a compiled decode step's constants) keeps the copy alive and fails here.
"""

import gc
import weakref
from pathlib import Path

import torch

import tunelab.peft.inference_merge as inference_merge
from tests.interop.adapter_checks import randomize_lora_b
from tunelab.config.lora import LoRAArgs
from tunelab.peft import LoRALinear
from tunelab.rl import ModelRolloutEngine, SamplingSettings
from tunelab.training import load_model

TINY = Path(__file__).resolve().parents[2] / "framework" / "tunelab" / "assets" / "tiny"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_the_merged_weights_are_freed_when_generate_returns(monkeypatch):
    lora = LoRAArgs(rank=8, alpha=16.0, targets=TARGETS)
    model = load_model(str(TINY), device=torch.device("cpu"), dtype=torch.float32, lora=lora)
    randomize_lora_b(model)
    merged: list[weakref.ref] = []
    merge = inference_merge.merge_weight

    def recorded_merge(*args, **kwargs):
        weight = merge(*args, **kwargs)
        merged.append(weakref.ref(weight))
        return weight

    monkeypatch.setattr(inference_merge, "merge_weight", recorded_merge)
    engine = ModelRolloutEngine(model, SamplingSettings(max_new_tokens=4), pad_id=2)
    prompts = [[0, 5, 6, 7], [0, 5, 6, 7], [0, 9, 8]]
    completions = engine.generate(prompts, [1, 2, 3])
    assert [len(c) for c in completions] == [4, 4, 4]  # no stop ids: full length
    num_layers = sum(isinstance(module, LoRALinear) for module in model.modules())
    assert len(merged) == num_layers > 0  # every layer generated merged
    gc.collect()
    alive = sum(ref() is not None for ref in merged)
    assert alive == 0, f"{alive} of {num_layers} merged weights outlive the rollout"
