"""A real 2-process LoRA run of ``tiny/moe_lora`` (a Mixtral upcycled from the tiny Llama).

FSDP2 shards the stacked experts over the ranks; the run trains LoRA on attention and on the
stacked expert weights with packed rows, saves, resumes exactly after a kill, and exports: the
merged weights (the expert updates merged shard by shard) in the hub's per-expert layout, which
transformers loads with no missing key, and an adapter that PEFT applies to the transformers
base with the logits of our merged export (where PEFT loads expert LoRA: peft >= 0.17 on
transformers 5). QLoRA with the experts split over the 2 processes (expert parallelism) trains
and exports as the FSDP run.
"""

import re

import pytest
import torch
from safetensors import safe_open

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    losses_by_step,
    our_model,
    read_metrics,
    tunelab_run,
)
from tests.recipes.moe_runs import (
    MOE_LORA_RUN,
    assert_export_is_the_adapted_base,
    assert_run_resumes_exactly,
    hf_eager,
    peft_loads_experts,
)
from tunelab._paths import assets_dir

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow
_RUN = (*MOE_LORA_RUN, "router.z_loss_coef=0.001")
# Experts split against FSDP: sums in another order; Adam carries them into the adapter
# (5.9e-6 seen).
EXPERT_PARALLEL_EXPORT_TOLERANCE = 1e-5


def test_two_process_moe_lora_resumes_exactly_and_exports_the_hub_layout(tmp_path):
    out = assert_run_resumes_exactly(tmp_path, *_RUN)
    assert all(r["router_z_loss"] > 0 for r in read_metrics(out) if "loss" in r)
    export = out / "epoch_0"
    with safe_open(export / "model.safetensors", "pt") as f:
        assert "model.layers.2.block_sparse_moe.experts.3.w2.weight" in set(f.keys())
    with safe_open(export / "adapter" / "adapter_model.safetensors", "pt") as f:
        adapter_keys = set(f.keys())
    assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight" in adapter_keys
    assert_export_is_the_adapted_base(export, assets_dir() / "tiny_moe")


_QLORA = (*_RUN, "lora.quantize_base=nf4")


@pytest.fixture(scope="module")
def qlora_2p(tmp_path_factory):
    """The 2-process QLoRA run (plain FSDP, 2 x 2 samples): its folder and its stderr."""
    out = tmp_path_factory.mktemp("moe_qlora_2p") / "qlora"
    result = tunelab_run("lora_finetune_distributed", "tiny/moe_lora", f"output_dir={out}", *_QLORA)
    return out, result.stderr


_ONE_PROCESS = (
    *_QLORA,
    "schedule.batch_size=4",
    "schedule.max_steps_per_epoch=2",
    "checkpoint.save_every_n_steps=null",
)


@pytest.fixture(scope="module")
def qlora_1p(tmp_path_factory):
    """The QLoRA run on 1 process, global batch 4 (the experts unsharded): its losses."""
    out = tmp_path_factory.mktemp("moe_qlora_1p")
    tunelab_run(
        "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={out}", *_ONE_PROCESS, nproc=1
    )
    return losses_by_step(out)


def _assert_close_losses(losses, reference, steps, tolerance):
    assert sorted(losses) == list(steps), losses
    for step in steps:
        assert abs(losses[step] - reference[step]) <= tolerance, (step, losses, reference)


def test_two_process_moe_qlora_resumes_exactly_and_exports_the_nf4_merge(qlora_2p, tmp_path):
    """QLoRA on the experts: 4 experts, 2 whole ones per rank, packed NF4 (attention is too
    small for NF4's blocks here and stays fp32). The run resumes exactly; transformers loads
    the merged export with no missing key; its experts are torchao's dequantized base plus
    the update, and PEFT's adapter on the NF4-rounded base has its logits (not the unquantized
    base's)."""
    from torchao.quantization import to_nf4

    from tunelab.models import load_pretrained
    from tunelab.peft.expert_lora import expert_delta
    from tunelab.peft.nf4 import is_nf4

    out, stderr = qlora_2p
    notice = next(line for line in stderr.splitlines() if "quantize_base nf4" in line)
    assert "6 weights in NF4" in notice and "experts" not in notice, notice
    losses = losses_by_step(out)
    assert sorted(losses) == [1, 2, 3] and all(
        map(torch.isfinite, torch.tensor([*losses.values()]))
    )
    resumed_dir = interrupted_copy(out, tmp_path / "resumed", after_step=2)
    tunelab_run(
        "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={resumed_dir}", *_QLORA,
        "checkpoint.resume_from_checkpoint=true",
    )  # fmt: skip
    assert losses_by_step(resumed_dir) == {3: losses[3]}

    export, base = out / "epoch_0", assets_dir() / "tiny_moe"
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        export, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokens = torch.randint(0, 810, (2, 17), generator=torch.Generator().manual_seed(0))
    if peft_loads_experts():
        # PEFT applies the adapter to the base whose stacked experts went through torchao's
        # NF4 (attention stayed fp32 in the run, as there): the merged export's logits.
        rounded, original = hf_eager(base), hf_eager(base)
        with torch.no_grad():
            for name, param in rounded.named_parameters():
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    flat = param.reshape(-1, param.shape[-1])
                    param.copy_(to_nf4(flat).get_original_weight().view(param.shape))
            expected = merged(tokens).logits
            adapted = peft.PeftModel.from_pretrained(rounded, export / "adapter").eval()
            assert float((adapted(tokens).logits - expected).abs().max()) <= 1e-4
            unrounded = peft.PeftModel.from_pretrained(original, export / "adapter").eval()
            assert float((unrounded(tokens).logits - expected).abs().max()) > 1e-3
    ours = our_model(base, export / "adapter", quantize_base="nf4")  # the adapter's factors
    experts = ours.layers[2].mlp.experts
    assert is_nf4(experts.gate_up_proj) and is_nf4(experts.down_proj)
    # Expert 3 of layer 2: torchao's dequantization of the whole stacked weight, then the
    # expert's update, equals the export (written by the rank that holds expert 3).
    stacked = load_pretrained(base).layers[2].mlp.experts.down_proj.detach()
    values = to_nf4(stacked.reshape(-1, stacked.shape[-1])).get_original_weight()
    adapter = experts.lora["down_proj"]
    delta = expert_delta(
        adapter.lora_A.weight.detach(), adapter.lora_B.weight.detach(), 4, adapter.scale
    )
    expected = values.view(stacked.shape)[3] + delta[3]
    with safe_open(export / "model.safetensors", "pt") as f:
        exported = f.get_tensor("model.layers.2.block_sparse_moe.experts.3.w2.weight")
    torch.testing.assert_close(exported, expected, rtol=0, atol=1e-6)
    assert float(delta[3].abs().max()) > 1e-4  # trained


def test_moe_qlora_compiles_to_the_same_losses_without_library_noise(qlora_1p, tmp_path):
    """``compile: true`` with NF4 experts (inductor's C++ backend, 1 process): the same losses
    as eager, and nothing on stderr but tunelab's own lines and the progress bar (torch's AOT
    autograd cache warned per compiled block that NF4Tensor has no stable hash, and failed to
    pickle the stacked experts' key with a traceback: peft/_nf4_compile.py)."""
    result = tunelab_run(
        "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={tmp_path}", *_ONE_PROCESS,
        "model.compile=true", nproc=1,
    )  # fmt: skip
    _assert_close_losses(losses_by_step(tmp_path), qlora_1p, [1, 2], 1e-5)
    lines = [line.strip() for line in result.stderr.replace("\r", "\n").splitlines()]
    foreign = [
        line
        for line in lines
        if line and not line.startswith("tunelab:") and not re.match(r"\d+%\|", line)  # tqdm
    ]
    assert not foreign, foreign


def test_hsdp_moe_qlora_matches_fsdp_and_resumes_on_fsdp(qlora_2p, tmp_path):
    """HSDP 2 x 2 (4 processes, 1 sample each) shards the NF4 experts as plain FSDP on 2 does
    (the same quantization: each shard group holds 2 whole experts): the same losses; its
    step 2 resumes on plain FSDP (2 processes) with the FSDP run's step-3 loss and export."""
    reference_dir, _ = qlora_2p
    reference = losses_by_step(reference_dir)
    out = tmp_path / "hsdp"
    tunelab_run(
        "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={out}", *_QLORA,
        "schedule.batch_size=1", "parallelism.data_parallel_replicate_size=2", "parallelism.data_parallel_shard_size=2",
        "model.frozen_base=shard", nproc=4,
    )  # fmt: skip
    _assert_close_losses(losses_by_step(out), reference, [1, 2, 3], 1e-6)
    resumed = interrupted_copy(out, tmp_path / "on_fsdp", after_step=2)
    tunelab_run(
        "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={resumed}", *_QLORA,
        "checkpoint.resume_from_checkpoint=true",
    )  # fmt: skip
    _assert_close_losses(losses_by_step(resumed), reference, [3], 1e-6)
    # The weights: equal up to the rounding of the other gradient sum (4 ranks' reduce-scatter
    # and all-reduce in HSDP, 2 ranks' in FSDP), which AdamW's normalisation carries into
    # the updates of steps 1-2 (1.1e-6 seen on weights of order 0.1).
    with safe_open(reference_dir / "epoch_0" / "model.safetensors", "pt") as expected:
        with safe_open(resumed / "epoch_0" / "model.safetensors", "pt") as exported:
            assert set(exported.keys()) == set(expected.keys())
            for key in expected.keys():
                torch.testing.assert_close(
                    exported.get_tensor(key), expected.get_tensor(key), rtol=0, atol=1e-5
                )


def test_expert_parallel_moe_qlora_matches_fsdp(qlora_2p, tmp_path):
    """QLoRA with the experts split (``expert_parallel_size`` 2 on 2 processes): each rank
    packs and quantizes its own 2 experts, the rows FSDP2's shard holds, to the same NF4
    bytes (the same 6 weights in NF4); the losses, the router loss and the exports are the
    FSDP run's to fp32 summation order."""
    reference_dir, _ = qlora_2p
    out = tmp_path / "ep"
    result = tunelab_run(
        "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={out}", *_QLORA,
        "parallelism.expert_parallel_size=2",
    )  # fmt: skip
    notice = next(line for line in result.stderr.splitlines() if "quantize_base nf4" in line)
    assert "6 weights in NF4" in notice and "experts" not in notice, notice
    ours, reference = _steps(out), _steps(reference_dir)
    assert sorted(ours) == sorted(reference) == [1, 2, 3]
    for step in ours:
        for name in ("loss", "router_aux_loss", "grad_norm"):
            expected = reference[step][name]
            assert abs(ours[step][name] - expected) <= 1e-5 * max(1.0, expected), (step, name)
    assert_same_exports(out, reference_dir, atol=EXPERT_PARALLEL_EXPORT_TOLERANCE)


def _steps(out):
    return {row["step"]: row for row in read_metrics(out) if "loss" in row}


def test_hsdp_of_whole_replicas_holds_the_nf4_experts_as_one_process(qlora_1p, tmp_path):
    """HSDP 2 x 1 (2 processes, each a whole replica): FSDP2 skips the gather of a group of
    one rank and hands NF4's hook one tensor (peft/_nf4_fsdp.py), for the stacked experts as
    for linears; the quantization and the losses are the 1-process run's."""
    result = tunelab_run(
        "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={tmp_path}", *_ONE_PROCESS,
        "schedule.batch_size=2", "parallelism.data_parallel_replicate_size=2", "parallelism.data_parallel_shard_size=1",
    )  # fmt: skip
    notice = next(line for line in result.stderr.splitlines() if "quantize_base nf4" in line)
    assert "12 weights in NF4" in notice, notice  # 1 process: experts and the larger linears
    _assert_close_losses(losses_by_step(tmp_path), qlora_1p, [1, 2], 1e-6)
