"""Expert parallelism in real 2-process runs (``parallelism.expert_parallel_size=2``, gloo).

Full fine-tuning of the embedded tiny Mixtral (4 experts, top-2) with the router term at lr
1e-4: each process holds 2 experts and sends tokens to the other's. The run equals one
process at the same micro-batches (1 x 2 accumulated = 2 x 1) within 1e-5: losses, gradient
norms, the router loss and the export. A checkpoint saved with experts split resumes exactly under plain FSDP, and one
saved by one process resumes exactly with experts split (DCP reshards: expert weights are
``Shard(0)`` DTensors either way). LoRA on the experts with experts split trains and exports
as one process. A tiny Qwen3-MoE run with experts split gives one process's losses,
gradient norms and router loss and exports the same bytes as the FSDP run (the learning rate
1e-30 leaves the weights as loaded, so the two exports can be compared byte for byte). A size
that does not divide the processes stops the run with one line. Per-rank ownership (shapes,
values) and the all-to-all bytes are checked in tests/unit/test_expert_parallel.py.

Expert groups smaller than the world: ``expert_parallel_size=2`` on 4 processes (2 replicas of
2 expert shards, the other weights FSDP2's over all 4) trains the Mixtral as one process at
the 4 micro-batches (1e-5), and a run killed after its step-2 checkpoint resumes in that
layout exactly (every later metric and the export bit for bit); the Qwen3-MoE export is the
FSDP run's bytes in that layout too. HSDP 2 x 2 with the same expert groups trains as one
process and resumes exactly in that layout, and exports the Qwen3-MoE FSDP run's bytes.

Tensor and expert parallelism together (``tensor_parallel_size=2`` with
``expert_parallel_size=2`` on the same 2 processes: attention split by heads, each rank's
half of the sequence routed to the experts by all-to-all): the Mixtral trains as one process
at the same micro-batches, router loss included (1e-5), each rank's checkpoint holds only its
own experts and heads, and its step-2 checkpoint resumes exactly under plain FSDP on 2
processes; the Qwen3-MoE (q/k norms, a dense MLP layer) gives one process's losses, gradient
norms and router loss, and exports the FSDP run's bytes. FSDP 2 x TP 2 with EP 2 on 4
processes trains the Mixtral as one process, and the Qwen3-MoE as its FSDP run, exporting the
same bytes.
"""

import json

import pytest

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    read_metrics,
    tunelab_run,
)
from tests.recipes.moe_runs import build_tiny_qwen3_moe

pytestmark = pytest.mark.slow

RUN = (
    "~lora",
    "~val_dataset",
    "dataset.packed=true",
    "schedule.batch_size=1",
    "schedule.epochs=1",
    "schedule.max_steps_per_epoch=3",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=2",
    "checkpoint.enable_async_checkpointing=false",
    "router.aux_loss_coef=0.01",
    # At tiny/moe_lora's lr 3e-3 Adam's first steps amplify rounding (each weight whose
    # gradient is near zero moves by up to lr): plain FSDP on 2 processes itself departs from
    # 1 process by 1.3e-5 relative in gradient norm at step 3 (measured).
    "optimizer.lr=1e-4",
)
"""Full fine-tuning of ``tiny/moe_lora``'s model: 3 steps of one pack per process, saved at 2."""
EXPERT_PARALLEL = "parallelism.expert_parallel_size=2"
ONE_PROCESS = "schedule.gradient_accumulation_steps=2"  # the 2 processes' micro-batches
RESUME = "checkpoint.resume_from_checkpoint=true"
TENSOR_AND_EXPERT = ("parallelism.tensor_parallel_size=2", EXPERT_PARALLEL)
HSDP = ("parallelism.data_parallel_replicate_size=2", "parallelism.data_parallel_shard_size=2")
"""HSDP 2 x 2 on 4 processes: the other weights sharded within pairs, replicated across them."""
# The Qwen3-MoE runs keep the weights as loaded, so exports compare byte for byte: lr 1e-30
# alone moves weights that are exactly 0 (the pad token's embedding row) by ~1e-30, by
# amounts that depend on the batch and the summation order; with eps 1e20 every Adam update
# rounds to 0.
FROZEN = ("optimizer.lr=1e-30", "optimizer.eps=1e20")
METRICS = ("loss", "grad_norm", "router_aux_loss")


def _run(out, *overrides, nproc=2, check=True):
    return tunelab_run(
        "full_finetune_distributed", "tiny/moe_lora", f"output_dir={out}", *RUN, *overrides,
        nproc=nproc, check=check,
    )  # fmt: skip


def _steps(out) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out) if "loss" in r}


def _assert_same_steps(run, reference, steps):
    for step in steps:
        for name in METRICS:
            ours, expected = run[step][name], reference[step][name]
            assert abs(ours - expected) <= 1e-5 * max(1.0, abs(expected)), (step, name, ours)


def _split_and_one(root, nproc):
    """The Mixtral run with experts split 2 ways on ``nproc`` processes, and on 1 process at
    the same micro-batches (``nproc`` accumulated): their folders."""
    _run(root / "split", EXPERT_PARALLEL, nproc=nproc)
    _run(root / "one", f"schedule.gradient_accumulation_steps={nproc}", nproc=1)
    return root / "split", root / "one"


def _assert_trains_as_one_process(runs):
    split, one = map(_steps, runs)
    assert sorted(split) == sorted(one) == [1, 2, 3]
    assert all(split[step]["router_aux_loss"] > 0 for step in split)
    assert split[3]["loss"] < split[1]["loss"]  # it trains
    _assert_same_steps(split, one, [1, 2, 3])


@pytest.fixture(scope="module")
def mixtral_runs(tmp_path_factory):
    """Experts split over 2 processes, and 1 process."""
    return _split_and_one(tmp_path_factory.mktemp("expert_parallel"), nproc=2)


@pytest.fixture(scope="module")
def expert_groups(tmp_path_factory):
    """Experts in groups of 2 on 4 processes (2 replicas), and 1 process."""
    return _split_and_one(tmp_path_factory.mktemp("expert_groups"), nproc=4)


def test_split_experts_train_as_one_process_router_loss_included(mixtral_runs):
    _assert_trains_as_one_process(mixtral_runs)
    assert_same_exports(*mixtral_runs, atol=1e-5)  # measured 7.5e-8


def test_split_experts_without_a_router_loss_train_as_one_process(tmp_path):
    # Without a router loss the last layer's experts take only the scored positions (the
    # trimmed last layer): each rank sends its own number of rows through the all-to-all.
    no_router_loss = "router.aux_loss_coef=0"
    _run(tmp_path / "split", EXPERT_PARALLEL, no_router_loss)
    _run(tmp_path / "one", ONE_PROCESS, no_router_loss, nproc=1)
    split, one = _steps(tmp_path / "split"), _steps(tmp_path / "one")
    assert sorted(split) == sorted(one) == [1, 2, 3]
    assert all("router_aux_loss" not in row for row in split.values())
    for step in split:
        for name in ("loss", "grad_norm"):
            ours, expected = split[step][name], one[step][name]
            assert abs(ours - expected) <= 1e-5 * max(1.0, abs(expected)), (step, name, ours)


def test_expert_groups_of_two_on_four_processes_train_as_one_process(expert_groups):
    _assert_trains_as_one_process(expert_groups)
    assert_same_exports(*expert_groups, atol=1e-5)  # measured 3e-7


def test_hsdp_with_expert_groups_trains_as_one_process_and_resumes_exactly(expert_groups, tmp_path):
    # HSDP 2 x 2 (the other weights sharded within pairs, replicated across them) with the
    # experts in groups of 2: FSDP2 still averages every gradient over all 4 processes, so
    # the run is the 1-process one at the same 4 micro-batches; killed after its step-2
    # checkpoint and resumed in that layout, step 3 and the export bit for bit.
    _, one = expert_groups
    out = tmp_path / "hsdp"
    _run(out, EXPERT_PARALLEL, *HSDP, nproc=4)
    _assert_trains_as_one_process((out, one))
    assert_same_exports(out, one, atol=1e-5)  # measured 3e-7
    resumed = interrupted_copy(out, tmp_path / "resumed", after_step=2, keep_logs=True)
    _run(resumed, EXPERT_PARALLEL, *HSDP, RESUME, nproc=4)
    ours, expected = _steps(resumed), _steps(out)
    for name in METRICS:
        assert ours[3][name] == expected[3][name], name
    assert_same_exports(resumed, out)


def test_kill_and_resume_within_expert_groups_is_exact(expert_groups, tmp_path):
    # What a kill right after step 2's checkpoint leaves (step 3 logged, no export), resumed
    # on the same 4 processes in the same layout: step 3 and the export bit for bit.
    groups, _ = expert_groups
    resumed = interrupted_copy(groups, tmp_path / "resumed", after_step=2, keep_logs=True)
    _run(resumed, EXPERT_PARALLEL, RESUME, nproc=4)
    assert [row["step"] for row in read_metrics(resumed) if "loss" in row] == [1, 2, 3]
    ours, expected = _steps(resumed), _steps(groups)
    for name in METRICS:
        assert ours[3][name] == expected[3][name], name
    assert_same_exports(resumed, groups)


def test_checkpoints_reshard_between_split_experts_and_fsdp(mixtral_runs, tmp_path):
    split, one = mixtral_runs
    # Saved with experts split, resumed under plain FSDP on 2 processes.
    to_fsdp = interrupted_copy(split, tmp_path / "to_fsdp", after_step=2)
    _run(to_fsdp, RESUME)
    _assert_same_steps(_steps(to_fsdp), _steps(split), [3])
    # Saved by one process (whole experts), resumed with experts split.
    to_split = interrupted_copy(one, tmp_path / "to_split", after_step=2)
    _run(to_split, EXPERT_PARALLEL, RESUME)
    _assert_same_steps(_steps(to_split), _steps(one), [3])
    assert sorted(_steps(to_fsdp)) == sorted(_steps(to_split)) == [3]


def test_lora_on_split_experts_trains_as_one_process(tmp_path):
    """LoRA on attention and on the experts (its factors FSDP2's, each process using its
    experts' slices): 2 steps equal 1 process's, and so do the exports (1e-5, measured
    3.6e-6). The same with TP 2 x EP 2 (one sample stream, 2 accumulated micro-batches):
    attention's adapters split with their bases, the experts' factors whole on both ranks,
    their gradients summed over the tp ranks; its exports within 1e-4 (at tiny/moe_lora's lr
    3e-3 Adam turns rounding-level differences of near-zero gradients into updates of up to
    lr: an expert lora_B value 2.1e-5 from 1 process's, measured)."""
    lora = (
        "~val_dataset", "dataset.packed=true", "schedule.batch_size=1", "schedule.epochs=1",
        "schedule.max_steps_per_epoch=2", "lr_scheduler.num_warmup_steps=0",
        "checkpoint.save_every_n_steps=null", "router.aux_loss_coef=0.01",
        "lora.targets=[q_proj,k_proj,v_proj,o_proj,experts.gate_up_proj,experts.down_proj]",
    )  # fmt: skip
    layouts = (
        ("split", 2, (EXPERT_PARALLEL,)), ("tp_ep", 2, (*TENSOR_AND_EXPERT, ONE_PROCESS)),
        ("one", 1, (ONE_PROCESS,)),
    )  # fmt: skip
    for name, nproc, settings in layouts:
        tunelab_run(
            "lora_finetune_distributed", "tiny/moe_lora", f"output_dir={tmp_path / name}",
            *lora, *settings, nproc=nproc,
        )  # fmt: skip
    for name, atol in (("split", 1e-5), ("tp_ep", 1e-4)):
        _assert_same_steps(_steps(tmp_path / name), _steps(tmp_path / "one"), [1, 2])
        assert_same_exports(tmp_path / name, tmp_path / "one", atol=atol)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """The tiny Qwen3-MoE (``base``), its FSDP run on 2 processes (``fsdp``) and its run on 1
    process at the same micro-batches (``one``, 2 accumulated), 2 steps with the weights kept
    as loaded (``FROZEN``): the folder holding them."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3MoeConfig"):
        pytest.skip("this transformers has no Qwen3-MoE")
    root = tmp_path_factory.mktemp("qwen3_moe")
    build_tiny_qwen3_moe(root / "base")
    _run(root / "fsdp", *_qwen3(root), *FROZEN)
    _run(root / "one", *_qwen3(root), *FROZEN, ONE_PROCESS, nproc=1)
    return root


def _qwen3(root) -> tuple[str, ...]:
    return (f"model.path={root / 'base'}", "schedule.max_steps_per_epoch=2")


def _assert_same_export_bytes(out, reference):
    exported = sorted(path.name for path in (reference / "epoch_0").iterdir())
    assert "model.safetensors" in exported
    for name in exported:
        if name.endswith((".safetensors", ".json")) and name != "tunelab_manifest.json":
            ours = (out / "epoch_0" / name).read_bytes()
            assert ours == (reference / "epoch_0" / name).read_bytes(), (out.name, name)


def test_qwen3_moe_split_experts_export_the_fsdp_runs_bytes(qwen3_moe, tmp_path):
    fsdp = qwen3_moe / "fsdp"
    _run(tmp_path / "split", *_qwen3(qwen3_moe), *FROZEN, EXPERT_PARALLEL)
    # Experts in groups of 2 on 4 processes (each expert held twice, written once; 4 samples
    # a step against the others' 2: only the exports compare).
    _run(tmp_path / "groups", *_qwen3(qwen3_moe), *FROZEN, EXPERT_PARALLEL, nproc=4)
    split = _steps(tmp_path / "split")
    assert sorted(split) == [1, 2] and all(row["router_aux_loss"] > 0 for row in split.values())
    _assert_same_steps(split, _steps(fsdp), [1, 2])
    _assert_same_steps(split, _steps(qwen3_moe / "one"), [1, 2])  # and one process's
    for layout in ("split", "groups"):
        _assert_same_export_bytes(tmp_path / layout, fsdp)


def test_a_size_that_does_not_divide_the_processes_stops_the_run_with_one_line(tmp_path):
    result = _run(tmp_path / "out", "parallelism.expert_parallel_size=3", check=False)
    assert result.returncode != 0
    line = "parallelism.expert_parallel_size: 3 does not divide the 2 processes of this run"
    assert line in result.stderr and "Traceback" not in result.stderr


# -- tensor and expert parallelism together ---------------------------------------------


@pytest.fixture(scope="module")
def tensor_and_expert(tmp_path_factory):
    """The Mixtral with TP 2 and EP 2 on the same 2 processes: one sample stream, so 2
    accumulated micro-batches, the global batch of ``mixtral_runs`` (2 x 1, 1 x 2)."""
    out = tmp_path_factory.mktemp("tensor_and_expert") / "run"
    _run(out, *TENSOR_AND_EXPERT, ONE_PROCESS)
    return out


def test_tp2_x_ep2_trains_as_one_process(tensor_and_expert, mixtral_runs):
    _, one = mixtral_runs
    _assert_trains_as_one_process((tensor_and_expert, one))
    assert_same_exports(tensor_and_expert, one, atol=1e-5)  # measured 5.9e-6


def test_tp2_x_ep2_ranks_save_only_their_experts_and_heads(tensor_and_expert):
    # The step-2 checkpoint as DCP wrote it: which rank's file holds which rows of each
    # weight. Rank r wrote experts 2r, 2r+1 of every layer (4 experts) and the q_proj rows of
    # its 2 heads (4 x 32 rows), nothing else of them.
    metadata = json.loads((tensor_and_expert / "step_2" / ".metadata.json").read_text())
    written: dict[str, dict[int, list]] = {}
    for fqn, offsets, _, file, *_ in metadata["items"]:
        written.setdefault(fqn, {}).setdefault(int(file.split("_")[2]), []).append(offsets)
    experts = [fqn for fqn in written if fqn.endswith(("experts.gate_up_proj", "experts.down_proj"))]  # fmt: skip
    queries = [fqn for fqn in written if fqn.endswith("self_attn.q_proj.weight")]
    assert len(experts) == 2 * 3 and len(queries) == 3, sorted(written)
    for fqn in experts:
        assert written[fqn] == {0: [[0, 0, 0]], 1: [[2, 0, 0]]}, fqn
        assert [sizes for _, sizes in metadata["tensors"][fqn]["chunks"]][0][0] == 2
    for fqn in queries:
        assert written[fqn] == {0: [[0, 0]], 1: [[64, 0]]}, fqn


def test_tp2_x_ep2_checkpoint_resumes_under_fsdp2(tensor_and_expert, tmp_path):
    # Saved with attention split by heads and the experts by owner, resumed under plain FSDP
    # on 2 processes (1 micro-batch each: the same global batch, the same micro-batches).
    out = interrupted_copy(tensor_and_expert, tmp_path / "to_fsdp", after_step=2)
    _run(out, RESUME)
    _assert_same_steps(_steps(out), _steps(tensor_and_expert), [3])
    assert sorted(_steps(out)) == [3]


def test_qwen3_moe_tp2_x_ep2_trains_as_one_process_and_exports_the_fsdp_runs_bytes(
    qwen3_moe, tmp_path
):
    # q/k norms over each rank's heads, a dense MLP layer split column/row-wise among the MoE
    # layers; 2 accumulated micro-batches against the FSDP run's 2 x 1 and 1 process's 1 x 2.
    out, one = tmp_path / "tp_ep", qwen3_moe / "one"
    _run(out, *_qwen3(qwen3_moe), *FROZEN, *TENSOR_AND_EXPERT, ONE_PROCESS)
    ours = _steps(out)
    assert sorted(ours) == [1, 2] and all(row["router_aux_loss"] > 0 for row in ours.values())
    _assert_same_steps(ours, _steps(one), [1, 2])
    _assert_same_export_bytes(out, qwen3_moe / "fsdp")


def test_fsdp2_x_tp2_with_ep2_on_four_processes_trains_as_one_process(mixtral_runs, tmp_path):
    # World mesh (shard 2, tp 2); the experts' (replicate 2, ep 2): ranks 0 and 1 (one tp
    # group, one sample stream) hold experts 0, 1 and 2, 3, and so do ranks 2 and 3.
    _, one = mixtral_runs
    _run(tmp_path / "run", *TENSOR_AND_EXPERT, nproc=4)
    _assert_trains_as_one_process((tmp_path / "run", one))
    assert_same_exports(tmp_path / "run", one, atol=1e-5)  # measured 5.9e-6


def test_qwen3_moe_four_process_layouts_export_the_fsdp_runs_bytes(qwen3_moe, tmp_path):
    # HSDP 2 x 2 with expert groups of 2 (4 samples a step: only the exports compare), and
    # FSDP 2 x TP 2 with EP 2 (two sample streams of 1: the FSDP run's micro-batches, so its
    # steps compare too; each expert written by one of its two holders, each tp block by the
    # ranks sharding it).
    _run(tmp_path / "hsdp", *_qwen3(qwen3_moe), *FROZEN, EXPERT_PARALLEL, *HSDP, nproc=4)
    _run(tmp_path / "fsdp_tp_ep", *_qwen3(qwen3_moe), *FROZEN, *TENSOR_AND_EXPERT, nproc=4)
    ours = _steps(tmp_path / "fsdp_tp_ep")
    assert sorted(ours) == [1, 2] and all(row["router_aux_loss"] > 0 for row in ours.values())
    _assert_same_steps(ours, _steps(qwen3_moe / "fsdp"), [1, 2])
    for layout in ("hsdp", "fsdp_tp_ep"):
        _assert_same_export_bytes(tmp_path / layout, qwen3_moe / "fsdp")
