"""distill_distributed with the real ``tunelab run``: 2 processes on gloo, a 2x wider tiny teacher.

The teacher is built once per session by a short SFT run of a 2x wider tiny Llama
(``tunelab.assets.build_tiny_teacher``); the runs are shared between the assertions.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    read_metrics,
    tunelab_run,
)

pytestmark = pytest.mark.slow

STEPS = 6
SETTINGS = [
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "schedule.run_val_every_n_steps=3",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=3",
    "checkpoint.keep_last_n_checkpoints=null",
    "checkpoint.enable_async_checkpointing=true",
]
# Some steps on-policy, some offline (the seeded draw; checked below).
ON_POLICY = ["on_policy.lmbda=0.5", "on_policy.max_new_tokens=12"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    from tunelab.assets.build_tiny_teacher import build_teacher

    return build_teacher(tmp_path_factory.mktemp("teacher") / "teacher", steps=30)


def _run(out: Path, config: str, teacher: Path, *overrides: str, nproc: int = 2) -> Path:
    tunelab_run(
        "distill_distributed",
        config,
        f"output_dir={out}",
        f"teacher.path={teacher}",
        *SETTINGS,
        *overrides,
        nproc=nproc,
    )
    return out


@pytest.fixture(scope="module")
def offline_2p(tmp_path_factory, teacher) -> Path:
    out = tmp_path_factory.mktemp("distill") / "offline_2p"
    return _run(out, "tiny/distill", teacher, "schedule.batch_size=4")


@pytest.fixture(scope="module")
def on_policy_2p(tmp_path_factory, teacher) -> Path:
    out = tmp_path_factory.mktemp("distill") / "on_policy_2p"
    return _run(out, "tiny/distill_on_policy", teacher, "schedule.batch_size=2", *ON_POLICY)


def _train_rows(out: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(out) if "loss" in m}


def _val_rows(out: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(out) if "val_loss" in m}


def test_two_processes_equal_one_with_twice_the_accumulation(offline_2p, teacher, tmp_path):
    one = _run(
        tmp_path / "offline_1p",
        "tiny/distill",
        teacher,
        "schedule.batch_size=4",
        "schedule.gradient_accumulation_steps=2",
        nproc=1,
    )
    two, single = _train_rows(offline_2p), _train_rows(one)
    assert sorted(two) == sorted(single) == list(range(1, STEPS + 1))
    for step in two:
        for key in ("loss", "distill", "teacher_kl", "student_entropy", "scored_tokens"):
            assert math.isclose(two[step][key], single[step][key], rel_tol=1e-5), (step, key)


def test_offline_kill_and_resume_is_exact(offline_2p, teacher, tmp_path):
    resumed = interrupted_copy(offline_2p, tmp_path / "resumed", after_step=3)
    tunelab_run(
        "distill_distributed",
        "tiny/distill",
        f"output_dir={resumed}",
        f"teacher.path={teacher}",
        *SETTINGS,
        "schedule.batch_size=4",
        "checkpoint.resume_from_checkpoint=true",
    )
    full, after = _train_rows(offline_2p), _train_rows(resumed)
    assert sorted(after) == [4, 5, 6]
    for step in after:
        assert after[step]["loss"] == full[step]["loss"], step
    assert_same_exports(resumed, offline_2p)


def test_on_policy_kill_and_resume_samples_the_same_tokens(on_policy_2p, teacher, tmp_path):
    full = _train_rows(on_policy_2p)
    sampled = [step for step, row in full.items() if row["on_policy"] == 1.0]
    # lmbda 0.5: both kinds of step (the seeded draw), and on-policy rows score only completions.
    assert 0 < len(sampled) < STEPS, sampled
    resumed = interrupted_copy(on_policy_2p, tmp_path / "resumed", after_step=3)
    tunelab_run(
        "distill_distributed",
        "tiny/distill_on_policy",
        f"output_dir={resumed}",
        f"teacher.path={teacher}",
        *SETTINGS,
        "schedule.batch_size=2",
        *ON_POLICY,
        "checkpoint.resume_from_checkpoint=true",
    )
    after = _train_rows(resumed)
    assert sorted(after) == [4, 5, 6]
    for step in after:
        for key in ("loss", "on_policy", "scored_tokens", "student_entropy"):
            assert after[step][key] == full[step][key], (step, key)
    assert_same_exports(resumed, on_policy_2p)


def test_export_loads_in_transformers_and_peft_with_equal_logits(offline_2p):
    import transformers
    from peft import PeftModel

    from tunelab._paths import assets_dir

    export = offline_2p / "epoch_0"
    tokens = torch.tensor([[0, 5, 17, 42, 99, 7, 300, 12]])
    merged = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        assets_dir() / "tiny", dtype=torch.float32
    )
    adapted = PeftModel.from_pretrained(base, export / "adapter").eval()
    with torch.no_grad():
        merged_logits = merged.eval()(tokens).logits
        adapted_logits = adapted(tokens).logits
    torch.testing.assert_close(merged_logits, adapted_logits, rtol=0, atol=1e-4)
    # The adapter trained: the student is not the base model.
    with adapted.disable_adapter(), torch.no_grad():
        base_logits = adapted(tokens).logits
    assert (merged_logits - base_logits).abs().max() > 1e-3


def test_validation_loss_falls_toward_the_teacher_and_not_at_a_vanishing_lr(
    offline_2p, teacher, tmp_path
):
    trained = _val_rows(offline_2p)
    frozen = _val_rows(
        _run(
            tmp_path / "lr0", "tiny/distill", teacher, "schedule.batch_size=4", "optimizer.lr=1e-12"
        )
    )
    assert sorted(trained) == sorted(frozen) == [3, 6]
    # Trained: the distillation loss and the student-teacher NLL gap shrink step by step.
    assert trained[6]["val_loss"] < trained[3]["val_loss"] < frozen[3]["val_loss"]
    gap = {s: abs(r["val_nll"] - r["val_teacher_nll"]) for s, r in trained.items()}
    assert gap[6] < gap[3]
    # A vanishing learning rate (0 is refused): nothing moves.
    assert abs(frozen[6]["val_loss"] - frozen[3]["val_loss"]) < 1e-6
    gap_frozen = {s: abs(r["val_nll"] - r["val_teacher_nll"]) for s, r in frozen.items()}
    assert abs(gap_frozen[6] - gap_frozen[3]) < 1e-6
    assert frozen[3]["val_teacher_nll"] == trained[3]["val_teacher_nll"]


@pytest.mark.parametrize(
    ("name", "variant"),
    [
        # QLoRA student, the teacher in bf16 and replicated (gathered once, kept).
        ("qlora", ["lora.quantize_base=nf4", "teacher.reshard_after_forward=false"]),
        # Every weight of the student trained, the teacher in bf16 and FSDP2-sharded.
        ("full", ["lora=null", "optimizer.lr=1e-4"]),
    ],
)
def test_qlora_and_full_students_learn_from_a_bf16_teacher(teacher, tmp_path, name, variant):
    out = _run(
        tmp_path / name, "tiny/distill", teacher, "schedule.batch_size=4",
        "schedule.max_steps_per_epoch=3", "checkpoint.save_every_n_steps=null",
        "teacher.dtype=bf16", *variant,
    )  # fmt: skip
    rows = _train_rows(out)
    assert sorted(rows) == [1, 2, 3]
    for row in rows.values():
        assert math.isfinite(row["loss"]) and math.isfinite(row["teacher_kl"]), row
        assert row["grad_norm"] > 0, row
    adapter = out / "epoch_0" / "adapter" / "adapter_model.safetensors"
    assert adapter.is_file() == (name == "qlora")
    # The student trained: QLoRA's adapters left zero (B starts at 0), full weights the base.
    if name == "qlora":
        trained = load_file(adapter)
        assert any(t.abs().max() > 0 for key, t in trained.items() if "lora_B" in key)
    else:
        trained = load_file(out / "epoch_0" / "model.safetensors")
        from tunelab._paths import assets_dir

        base = load_file(assets_dir() / "tiny" / "model.safetensors")
        key = "model.layers.0.mlp.down_proj.weight"
        assert not torch.equal(trained[key].float(), base[key].float())


def test_a_teacher_of_another_vocabulary_is_refused_in_one_line(teacher, tmp_path):
    # Two ordinary tokens with each other's ids: another tokenizer, not a special-token
    # difference that could be mapped by content (tests/unit/test_teacher_vocabulary.py).
    other = tmp_path / "other_teacher"
    shutil.copytree(teacher, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["red"], vocab["blue"] = vocab["blue"], vocab["red"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    result = tunelab_run(
        "distill_distributed",
        "tiny/distill",
        f"output_dir={tmp_path / 'out'}",
        f"teacher.path={other}",
        check=False,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "beyond special tokens" in line]
    assert len(lines) == 1 and "teacher.path" in lines[0], result.stderr[-2000:]


def test_precomputed_teacher_top_k_gives_the_live_losses_and_then_needs_no_teacher(
    teacher, tmp_path
):
    # Offline, top-k 8, no validation: the live teacher's top-k, then the same run computing
    # the cache (one teacher pass) and training from it, then a run that only reads it.
    common = [
        f"teacher.path={teacher}", "loss.top_k=8", "~val_dataset", "schedule.batch_size=4",
        f"dataset.cache_dir={tmp_path / 'data_cache'}", "schedule.max_steps_per_epoch=4",
    ]  # fmt: skip
    runs = {}
    for name, extra in [("live", []), ("builds", ["teacher.precompute_top_k=true"]),
                        ("reads", ["teacher.precompute_top_k=true"])]:  # fmt: skip
        result = tunelab_run(
            "distill_distributed", "tiny/distill", f"output_dir={tmp_path / name}", *SETTINGS,
            *common, *extra,
        )  # fmt: skip
        runs[name] = (_train_rows(tmp_path / name), result.stdout + result.stderr)
    live, (built, built_log), (read, read_log) = runs["live"][0], runs["builds"], runs["reads"]
    assert sorted(live) == sorted(built) == sorted(read) == [1, 2, 3, 4]
    for step in live:
        for key in ("loss", "distill", "nll", "student_entropy", "scored_tokens"):
            assert math.isclose(built[step][key], live[step][key], rel_tol=1e-6), (step, key)
            assert read[step][key] == built[step][key], (step, key)
    assert built_log.count("teacher top-k (k=8) of 1600 samples") == 1, built_log[-3000:]
    assert "teacher top-k (k=8) of" not in read_log and "the teacher is not loaded" in read_log
