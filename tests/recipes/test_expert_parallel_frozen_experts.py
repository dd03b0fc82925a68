"""Qwen3-MoE LoRA on attention only, its experts frozen and split (expert parallelism, issue 45).

Real ``tunelab run`` (gloo, fp32) of ``tiny/moe_lora`` on the tiny Qwen3-MoE of
``moe_runs.build_tiny_qwen3_moe`` (4 experts, top-2, q/k norms, a dense MLP layer among the MoE
ones) with its shipped targets (q/k/v/o_proj): the experts and routers are frozen, yet tokens
still travel to their experts by all-to-all and the router term's gradient reaches the
adapters through the hidden states. With ``expert_parallel_size=2`` on 2 processes (2 whole
experts per rank) the run equals 1 process at the same micro-batches (1 x 2 accumulated = 2 x
1) for 4 steps: losses, gradient norms and the router loss within 1e-5, the exports (merged
model, adapter) within 1e-4 (Adam, as in ``test_expert_parallel.py``); and the merged
export's expert and router weights are the base's, bit for bit.
"""

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import assert_same_exports, read_metrics, tunelab_run
from tests.recipes.moe_runs import build_tiny_qwen3_moe

pytestmark = pytest.mark.slow

STEPS = 4
RUN = (
    "~val_dataset",
    "dataset.packed=true",
    "schedule.batch_size=1",
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=null",
    "checkpoint.enable_async_checkpointing=false",
    "router.aux_loss_coef=0.01",
)
METRICS = ("loss", "grad_norm", "router_aux_loss")


def _steps(out) -> dict[int, dict]:
    return {row["step"]: row for row in read_metrics(out) if "loss" in row}


def test_qwen3_moe_attention_lora_with_frozen_split_experts_trains_as_one_process(tmp_path):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3MoeConfig"):
        pytest.skip("this transformers has no Qwen3-MoE")
    base = tmp_path / "base"
    build_tiny_qwen3_moe(base)
    layouts = (
        ("split", 2, ("parallelism.expert_parallel_size=2",)),
        ("one", 1, ("schedule.gradient_accumulation_steps=2",)),
    )
    for name, nproc, settings in layouts:
        tunelab_run(
            "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={tmp_path / name}",
            f"model.path={base}", *RUN, *settings, nproc=nproc,
        )  # fmt: skip
    split, one = _steps(tmp_path / "split"), _steps(tmp_path / "one")
    assert sorted(split) == sorted(one) == list(range(1, STEPS + 1))
    assert split[STEPS]["loss"] < split[1]["loss"]  # it trains
    for step in split:
        assert split[step]["router_aux_loss"] > 0
        for metric in METRICS:
            ours, expected = split[step][metric], one[step][metric]
            assert abs(ours - expected) <= 1e-5 * max(1.0, abs(expected)), (step, metric, ours)
    assert_same_exports(tmp_path / "split", tmp_path / "one", atol=1e-4)
    # Frozen: the experts and routers exported are the loaded ones.
    loaded = load_file(base / "model.safetensors")
    merged = load_file(tmp_path / "split" / "epoch_0" / "model.safetensors")
    frozen = [key for key in loaded if ".mlp.experts." in key or key.endswith(".mlp.gate.weight")]
    assert len(frozen) >= 4, sorted(loaded)
    for key in frozen:
        assert torch.equal(merged[key], loaded[key]), key
    adapted = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[adapted], loaded[adapted])  # the adapters merged
