"""Context parallelism through the real ``tunelab run``: 2 processes splitting every sequence
(``context_parallel_size=2``) train as 1 process on whole sequences.

The model is the tiny one turned Mistral (every layer a sliding window of 48 keys; GQA with 4
query and 2 key/value heads), the rows packed to 250 tokens (several documents each; the split
pads them to 252). Both runs take the same 4 samples per step (the 2 ranks of the cp group
share theirs), so the losses, the validation loss (unpacked rows) and the export agree to fp32
rounding; a run killed after step 2 resumes exactly with cp 2, and with cp 1 on 1 process (the
step checkpoint is DCP-sharded over the shard x cp ranks, which a resume reshards). cp 2 x tp 2
on 4 processes (each cp slice split again over the tensor-parallel ranks) equals it too.
"""

import json
import shutil

import pytest

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    read_metrics,
    tunelab_run,
)
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow

TOLERANCE = 1e-6
STEPS = 4
SETTINGS = [
    "dataset.packed=true",
    "dataset.max_seq_len=250",
    "tokenizer.max_seq_len=250",
    "schedule.batch_size=4",
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "schedule.run_val_every_n_steps=2",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=2",
    "checkpoint.keep_last_n_checkpoints=null",
]


@pytest.fixture(scope="module")
def window_model(tmp_path_factory):
    """The tiny model as a Mistral: the same weights, every layer a 48-key sliding window."""
    folder = tmp_path_factory.mktemp("tiny_window")
    shutil.copytree(assets_dir() / "tiny", folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=48)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _run(output_dir, model, *overrides, nproc, check=True):
    return tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={output_dir}",
        f"model.path={model}", *SETTINGS, *overrides, nproc=nproc, check=check,
    )  # fmt: skip


def _metric(output_dir, key):
    return {row["step"]: row[key] for row in read_metrics(output_dir) if key in row}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, window_model):
    """(whole sequences on 1 process, cp 2 on 2 processes), both read-only."""
    root = tmp_path_factory.mktemp("cp_runs")
    whole, split = root / "whole", root / "cp2"
    _run(whole, window_model, nproc=1)
    _run(split, window_model, "parallelism.context_parallel_size=2", nproc=2)
    return whole, split


def _assert_close(ours, reference, steps, tolerance):
    assert sorted(ours) == list(steps), ours
    for step in steps:
        assert abs(ours[step] - reference[step]) <= tolerance, (step, ours[step], reference[step])


def test_cp2_losses_equal_the_unsplit_run(runs):
    whole, split = runs
    _assert_close(_metric(split, "loss"), _metric(whole, "loss"), range(1, STEPS + 1), TOLERANCE)
    _assert_close(_metric(split, "val_loss"), _metric(whole, "val_loss"), [2, 4], TOLERANCE)
    # Every target counted once: the step's token count is the unsplit run's.
    tokens = _metric(whole, "num_tokens")
    assert sorted(tokens) == list(range(1, STEPS + 1)) and all(tokens.values()), tokens
    assert _metric(split, "num_tokens") == tokens
    assert_same_exports(split, whole, atol=1e-5)
    # FSDP shards over the shard x cp ranks: each tensor of the step checkpoint in 2 pieces.
    metadata = json.loads((split / "step_2" / ".metadata.json").read_text())
    for name, tensor in metadata["tensors"].items():
        if tensor["size"] and tensor["size"][0] >= 2:
            assert len(tensor["chunks"]) == 2, (name, tensor["chunks"])


def test_cp2_resumes_exactly(runs, window_model, tmp_path):
    _, split = runs
    out = interrupted_copy(split, tmp_path / "resumed", after_step=2)
    _run(out, window_model, "parallelism.context_parallel_size=2", "checkpoint.resume_from_checkpoint=true",
         nproc=2)  # fmt: skip
    _assert_close(_metric(out, "loss"), _metric(split, "loss"), range(3, STEPS + 1), 0)
    assert_same_exports(out, split)


def test_cp2_checkpoint_resumes_with_cp1_on_one_process(runs, window_model, tmp_path):
    whole, split = runs
    out = interrupted_copy(split, tmp_path / "resumed", after_step=2)
    _run(out, window_model, "checkpoint.resume_from_checkpoint=true", nproc=1)
    _assert_close(_metric(out, "loss"), _metric(whole, "loss"), range(3, STEPS + 1), TOLERANCE)
    assert_same_exports(out, whole, atol=1e-5)


def test_cp2_checkpoint_resumes_with_cp1_on_two_processes(runs, window_model, tmp_path):
    # The same 2 processes become 2 data-parallel ranks: the recorded global batch of 4 is
    # kept as 2 samples each.
    whole, split = runs
    out = interrupted_copy(split, tmp_path / "resumed", after_step=2)
    result = _run(out, window_model, "checkpoint.resume_from_checkpoint=true", nproc=2)
    assert "global batch of 4 on 2 process(es): batch_size 2" in result.stdout + result.stderr
    _assert_close(_metric(out, "loss"), _metric(whole, "loss"), range(3, STEPS + 1), TOLERANCE)


def test_cp_larger_than_the_world_is_one_error_naming_the_key(window_model, tmp_path):
    result = _run(
        tmp_path / "out", window_model, "parallelism.context_parallel_size=2", nproc=1, check=False
    )
    assert result.returncode != 0
    assert "context_parallel_size = 1 x 2 does not divide the 1 processes" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "mesh",
    [
        # replicate 2 x shard 1 x cp 2: each replica's cp group takes 2 of the step's 4 samples.
        ["parallelism.data_parallel_replicate_size=2", "model.frozen_base=shard"],
        # plain FSDP over all 4 (shard 2 x cp 2): 2 data-parallel groups of 2 samples.
        [],
    ],
    ids=["hsdp_2x1xcp2", "fsdp_2xcp2"],
)
def test_4_processes_with_cp2_equal_the_unsplit_run(runs, window_model, tmp_path, mesh):
    whole, _ = runs
    out = tmp_path / "mesh_cp"
    _run(
        out,
        window_model,
        "schedule.batch_size=2",
        "parallelism.context_parallel_size=2",
        *mesh,
        nproc=4,
    )
    _assert_close(_metric(out, "loss"), _metric(whole, "loss"), range(1, STEPS + 1), TOLERANCE)
    assert _metric(out, "num_tokens") == _metric(whole, "num_tokens") != {}


def test_cp2_x_tp2_on_4_processes_equals_the_unsplit_run(runs, window_model, tmp_path):
    # cp 2 x tp 2, one sample stream of 4: packed rows (document masks over the whole row),
    # the sliding window and GQA (2 key/value heads: one per tp rank, gathered over cp), each
    # cp slice split again over tp between the blocks, the loss over the tp-split vocabulary.
    # The TP tests' bounds: split matmuls and the vocabulary's softmax statistics summed over
    # ranks add rounding (measured: losses 4.2e-7, validation 3.8e-8, adapter 3.2e-6).
    whole, _ = runs
    out = tmp_path / "cp2_tp2"
    _run(out, window_model, "parallelism.context_parallel_size=2",
         "parallelism.tensor_parallel_size=2", nproc=4)  # fmt: skip
    _assert_close(_metric(out, "loss"), _metric(whole, "loss"), range(1, STEPS + 1), 1e-5)
    _assert_close(_metric(out, "val_loss"), _metric(whole, "val_loss"), [2, 4], 1e-5)
    assert_same_exports(out, whole, atol=1e-5)


def test_full_finetune_with_cp2_equals_the_unsplit_run(window_model, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "cp2"
    for out, nproc, extra in ((whole, 1, []), (split, 2, ["parallelism.context_parallel_size=2"])):
        tunelab_run(
            "full_finetune_distributed", "tiny/full", f"output_dir={out}",
            f"model.path={window_model}", *SETTINGS, "schedule.max_steps_per_epoch=2",
            "schedule.run_val_every_n_steps=null", *extra, nproc=nproc,
        )  # fmt: skip
    _assert_close(_metric(split, "loss"), _metric(whole, "loss"), [1, 2], TOLERANCE)


@pytest.mark.parametrize("scope", ["block", "attention"])
def test_cp2_with_selective_checkpointing_equals_the_unsplit_run_and_offload_is_a_cpu_no_op(
    runs, window_model, tmp_path, scope
):
    """cp 2 with selective checkpointing trains as the unsplit run (the recomputed forward
    gathers keys and values again in the backward).

    ``offload_activations=true`` is given only to check that the setting is accepted with cp
    and checkpointing and that the CPU no-op is said once: on CPU ``ActivationOffload`` does
    nothing, so this test says nothing about offloading itself. That is
    tests/unit/test_activation_memory.py's CUDA test, which skips without a GPU (not yet run).
    """
    whole, _ = runs
    out = tmp_path / "cp2_checkpointed"
    result = _run(
        out, window_model, "parallelism.context_parallel_size=2", "model.activation_checkpointing=true",
        "model.activation_checkpointing_every=2", f"model.activation_checkpointing_scope={scope}",
        "model.offload_activations=true", "schedule.max_steps_per_epoch=2", "schedule.run_val_every_n_steps=null",
        nproc=2,
    )  # fmt: skip
    _assert_close(_metric(out, "loss"), _metric(whole, "loss"), [1, 2], TOLERANCE)
    assert result.stderr.count("offload_activations: activations on cpu") == 1, result.stderr


def test_moe_router_loss_under_cp2_equals_the_unsplit_run(tmp_path):
    # tiny/moe_lora (4 experts, top-2) with the load-balancing loss and the z-loss in the
    # objective: each rank's routing statistics are summed over the cp group, so the logged
    # router_aux_loss and router_z_loss and the gradients (hence the later losses) are the
    # unsplit run's.
    runs = {}
    for nproc, extra in ((1, []), (2, ["parallelism.context_parallel_size=2"])):
        out = tmp_path / f"moe_{nproc}"
        tunelab_run(
            "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={out}",
            "dataset.packed=true", "dataset.max_seq_len=250", "tokenizer.max_seq_len=250",
            "schedule.batch_size=2", "schedule.epochs=1", "schedule.max_steps_per_epoch=3", "~val_dataset",
            "lr_scheduler.num_warmup_steps=0", "checkpoint.save_every_n_steps=null",
            "router.aux_loss_coef=0.5", "router.z_loss_coef=0.1", *extra, nproc=nproc,
        )  # fmt: skip
        runs[nproc] = out
    for key in ("loss", "router_aux_loss", "router_z_loss"):
        _assert_close(_metric(runs[2], key), _metric(runs[1], key), [1, 2, 3], TOLERANCE)
    # Gradient norms of about 5-7: fp32 sums in another order differ by about 3e-6.
    _assert_close(_metric(runs[2], "grad_norm"), _metric(runs[1], "grad_norm"), [1, 2, 3], 1e-5)
