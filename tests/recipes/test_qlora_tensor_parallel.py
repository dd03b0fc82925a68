"""QLoRA under tensor parallelism trains as 1 process (issue 45's "the same holds for QLoRA").

Real ``tunelab run`` (gloo, fp32), 12 steps of ``tiny/qlora`` at one global batch of 8 on a
tiny Llama with 4 query and 4 K/V heads (hidden 256, feed-forward 512) whose every linear
weight but ``lm_head`` holds whole NF4 blocks of scales on each of 4 processes (a quarter of
``k_proj`` is 64 x 256 values, 16384: one group of 256 blocks of 64). Each rank quantizes its
own piece of every weight to one process's NF4 bytes (``tests/recipes/tp_nf4_script.py``), so:

- TP 2 on 2 processes equals 1 process: losses and gradient norms within 1e-5, the merged
  export and the adapter within 1e-4 (Adam turns rounding-level differences of near-zero
  gradients into updates of up to lr, as in ``test_tensor_parallel.py``);
- FSDP 2 x TP 2 on 4 processes equals 1 process the same way.

No run keeps a weight "in the training dtype" (every one of them quantized).

With expert parallelism too, on a tiny Qwen3-MoE whose attention, dense layer and each rank's
experts hold whole NF4 groups (LoRA on all of them, the router term on): TP 2 x EP 2 on 2
processes and FSDP 2 x TP 2 x EP 2 on 4 equal 1 process at the same micro-batches, and a TP x EP
run killed after a checkpoint resumes exactly.
"""

import json
import shutil

import pytest
import torch

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    read_metrics,
    tunelab_run,
)
from tests.recipes.moe_runs import MOE_LORA_RUN, build_tiny_qwen3_moe
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow

TINY = assets_dir() / "tiny"
STEPS = 12
SETTINGS = (
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "~val_dataset",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=null",
    "checkpoint.enable_async_checkpointing=false",
)
TP2 = "parallelism.tensor_parallel_size=2"
LOSS_TOLERANCE = 1e-5
GRAD_NORM_RELATIVE = 1e-5
EXPORT_TOLERANCE = 1e-4  # the adapter's factors (Adam's first steps: see test_tensor_parallel)
MERGED_TOLERANCE = 1e-5  # the merged weights, the bound (measured 6.4e-7, 1.4e-6)
KEPT = "kept in the training dtype"  # the notice naming weights left unquantized


def _llama_with_whole_nf4_quarters(path):
    """Save a random fp32 Llama at ``path`` (the tiny tokenizer) whose linear weights split 4
    ways into whole NF4 scale groups: 4 K/V heads of 64, so ``k_proj`` is 256 x 256."""
    transformers = pytest.importorskip("transformers")
    ids = json.loads((TINY / "config.json").read_text())
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=64, vocab_size=ids["vocab_size"],
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"], tie_word_embeddings=True, initializer_range=0.05,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY / name, path / name)
    return path


def _run(out, model, *overrides, nproc):
    result = tunelab_run(
        "lora_finetune_distributed", "tiny/qlora", f"output_dir={out}", f"model.path={model}",
        *SETTINGS, *overrides, nproc=nproc,
    )  # fmt: skip
    assert KEPT not in result.stdout + result.stderr, result.stderr[-2000:]
    return out


def _metric(output_dir, key):
    return {row["step"]: row[key] for row in read_metrics(output_dir) if key in row}


def _assert_same_training(ours, reference):
    losses, expected = _metric(ours, "loss"), _metric(reference, "loss")
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert losses[STEPS] < losses[1]  # it trains
    for step in losses:
        assert abs(losses[step] - expected[step]) <= LOSS_TOLERANCE, (step, losses, expected)
    norms, expected = _metric(ours, "grad_norm"), _metric(reference, "grad_norm")
    for step in losses:
        assert abs(norms[step] - expected[step]) <= GRAD_NORM_RELATIVE * expected[step], (
            step, norms[step], expected[step],
        )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The model, and its 1-process QLoRA run (batch 8): their folders."""
    root = tmp_path_factory.mktemp("qlora_tp")
    model = _llama_with_whole_nf4_quarters(root / "base")
    return model, _run(root / "one", model, "schedule.batch_size=8", nproc=1)


def test_qlora_tp2_equals_one_process(runs, tmp_path):
    model, one = runs
    tp2 = _run(tmp_path / "tp2", model, TP2, "schedule.batch_size=8", nproc=2)
    _assert_same_training(tp2, one)
    assert_same_exports(tp2, one, atol=EXPORT_TOLERANCE, merged_atol=MERGED_TOLERANCE)


def test_qlora_fsdp2_x_tp2_on_four_processes_equals_one_process(runs, tmp_path):
    # Mesh (shard 2, tp 2): each tp piece's rows sharded over 2 more processes, each quarter
    # quantized on its own rank; 4 samples per sample stream.
    model, one = runs
    out = _run(tmp_path / "fsdp2_tp2", model, TP2, "schedule.batch_size=4",
               "model.frozen_base=shard", nproc=4)  # fmt: skip
    _assert_same_training(out, one)
    assert_same_exports(out, one, atol=EXPORT_TOLERANCE, merged_atol=MERGED_TOLERANCE)


# -- with expert parallelism --------------------------------------------------------------

QWEN3_MOE = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
}
"""A tiny Qwen3-MoE (``moe_runs.build_tiny_qwen3_moe``: layer 0 MoE, layer 1 dense) whose
attention and dense MLP weights hold whole NF4 groups per quarter, and whose experts do per
rank (2 of 4: 2 x 256 x 256 values of ``gate_up_proj``, 2 x 256 x 128 of ``down_proj``)."""
MOE_RUN = (
    *MOE_LORA_RUN,  # later overrides win
    "schedule.batch_size=1",
    "lora.quantize_base=nf4",
    "lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,"
    "experts.gate_up_proj,experts.down_proj]",
)
TP2_EP2 = (TP2, "parallelism.expert_parallel_size=2")
TWO_MICRO_BATCHES = "schedule.gradient_accumulation_steps=2"
METRICS = ("step", "loss", "grad_norm", "router_aux_loss")
# 8 attention weights, the dense layer's 3, the MoE layer's 2 stacked expert weights.
IN_NF4 = "13 weights in NF4, 1 kept in the training dtype (model.layers.0.mlp.gate: an MoE router"


def _moe_run(out, base, *overrides, nproc):
    result = tunelab_run(
        "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={out}",
        f"model.path={base}", *MOE_RUN, *overrides, nproc=nproc,
    )  # fmt: skip
    assert IN_NF4 in result.stdout + result.stderr, result.stderr[-2000:]
    return out


def test_qlora_with_tensor_and_expert_parallelism_trains_as_one_process(tmp_path):
    """Attention and the dense layer split over tp, the experts over ep, each rank quantizing
    its own pieces and experts: TP 2 x EP 2 on 2 processes (2 accumulated micro-batches) and
    FSDP 2 x TP 2 x EP 2 on 4 equal 1 process at the same 2 micro-batches for 3 steps (loss,
    gradient norm, router loss within 1e-5; exports within 1e-4, Adam), and the TP x EP run
    killed after its step-2 checkpoint resumes exactly (step 3 and the export bit for bit)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3MoeConfig"):
        pytest.skip("this transformers has no Qwen3-MoE")
    base = tmp_path / "base"
    build_tiny_qwen3_moe(base, **QWEN3_MOE)
    one = _moe_run(tmp_path / "one", base, TWO_MICRO_BATCHES, nproc=1)
    tp_ep = _moe_run(tmp_path / "tp_ep", base, *TP2_EP2, TWO_MICRO_BATCHES, nproc=2)
    four = _moe_run(tmp_path / "fsdp_tp_ep", base, *TP2_EP2, nproc=4)
    expected = {row["step"]: row for row in read_metrics(one) if "loss" in row}
    assert sorted(expected) == [1, 2, 3] and expected[3]["loss"] < expected[1]["loss"]
    for run in (tp_ep, four):
        ours = {row["step"]: row for row in read_metrics(run) if "loss" in row}
        assert sorted(ours) == [1, 2, 3], run.name
        for step in ours:
            assert ours[step]["router_aux_loss"] > 0
            for key in METRICS[1:]:
                value, reference = ours[step][key], expected[step][key]
                assert abs(value - reference) <= 1e-5 * max(1.0, reference), (run.name, step, key)
        assert_same_exports(run, one, atol=EXPORT_TOLERANCE, merged_atol=MERGED_TOLERANCE)
    resumed = interrupted_copy(tp_ep, tmp_path / "resumed", after_step=2, keep_logs=True)
    _moe_run(resumed, base, *TP2_EP2, TWO_MICRO_BATCHES, "checkpoint.resume_from_checkpoint=true",
             nproc=2)  # fmt: skip
    steps = [{key: row[key] for key in METRICS} for row in read_metrics(resumed) if "loss" in row]
    assert steps == [
        {key: row[key] for key in METRICS} for row in read_metrics(tp_ep) if "loss" in row
    ]
    assert_same_exports(resumed, tp_ep)
