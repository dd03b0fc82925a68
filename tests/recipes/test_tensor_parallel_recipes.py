"""Tensor parallelism with DoRA and LoRA dropout, and in the other training recipes (issue 45).

``parallelism.tensor_parallel_size=2`` on 2 gloo processes trains as 1 process with the same
global batch: lora_finetune_distributed with DoRA and adapter dropout,
lora_dpo_distributed (DPO), kto_distributed, reward_model_distributed (the score head
replicated, reading the gathered sequence) and distill_distributed (whole logits,
``model.chunked_output=false``; teacher and student both split). 3 steps each; every logged
metric (loss, gradient norm, rewards, margins, KL estimates, log-probs) and the exports agree.
DPO also runs with ``parallelism.expert_parallel_size=2`` on the tiny Mixtral, against 1
process with both processes' pairs.

The runs use plain SGD: Adam turns rounding-level differences of near-zero gradients into
updates of up to lr each (tests/recipes/test_tensor_parallel.py), and SGD leaves them at
rounding level, so the exports can be held to 1e-5. At lr 1.0 the DPO run amplifies rounding
too: FSDP=2 itself departs from 1 process by 2.7e-5 relative in gradient norm at step 3
(TP=2 5.8e-5, measured); at 0.1 both stay within 2e-6.
The unit part checks distillation's one-line refusals.
"""

import shutil

import pytest

from tests.conftest import build_tiny_hf_model
from tests.recipes.conftest import assert_same_exports, read_metrics, tunelab_run
from tunelab._paths import assets_dir
from tunelab.config.distill import DistillArgs, OnPolicyArgs, TeacherArgs
from tunelab.config.sections import LoRAModelSetupArgs, ModelParallelismArgs

STEPS = 3
SETTINGS = (
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "lr_scheduler.num_warmup_steps=0",
    "optimizer._component_=torch.optim.SGD",
    "optimizer.lr=0.1",
    "checkpoint.save_every_n_steps=null",
    "checkpoint.enable_async_checkpointing=false",
)
TP2 = "parallelism.tensor_parallel_size=2"
# Timings and memory differ by nature. Token counts (distillation's scored_tokens) are
# compared: tensor-parallel ranks share their tokens, and each is counted once.
NOT_COMPARED = {"step", "lr", "tokens_per_second", "peak_memory_gib"}
TOLERANCE = 1e-5


def _rows(out) -> dict[int, dict]:
    return {row["step"]: row for row in read_metrics(out) if "loss" in row}


def _assert_tp2_equals_one_process(tmp_path, recipe, config, *overrides, split=(TP2,), one=()):
    """The run on 2 processes with ``split`` equals the one on 1 process with ``one``."""
    runs = {}
    for name, nproc, extra in (("one", 1, one), ("split", 2, split)):
        runs[name] = tmp_path / name
        tunelab_run(recipe, config, f"output_dir={runs[name]}", *SETTINGS, *overrides, *extra,
                    nproc=nproc)  # fmt: skip
    ours, expected = _rows(runs["split"]), _rows(runs["one"])
    assert sorted(ours) == sorted(expected) == list(range(1, STEPS + 1))
    for step, row in expected.items():
        keys = row.keys() - NOT_COMPARED
        assert keys <= ours[step].keys(), (step, keys - ours[step].keys())
        for key in keys:
            value = ours[step][key]
            assert abs(value - row[key]) <= TOLERANCE * max(1.0, abs(row[key])), (step, key, value, row[key])  # fmt: skip
    assert expected[STEPS]["loss"] != expected[1]["loss"]  # it trained
    assert_same_exports(runs["split"], runs["one"], atol=TOLERANCE)
    return ours


@pytest.mark.slow
def test_dora_with_lora_dropout_tp2_equals_one_process(tmp_path):
    # DoRA's magnitude split like the rows under column-wise bases, replicated under row-wise
    # ones (their row norms summed over the ranks' columns); dropout masks drawn whole and
    # cut, so every rank applies one process's mask. Packed rows of 128 tokens: no padding
    # to a multiple of 2, which would draw masks of another shape than one process does.
    # (torch's own dropout of the DTensor inputs gives another gradient norm at step 1,
    # 5.624 against 5.524: measured.)
    _assert_tp2_equals_one_process(
        tmp_path, "lora_finetune_distributed", "tiny/dora", "lora.dropout=0.1",
        "dataset.packed=true", "schedule.batch_size=2", "~val_dataset",
    )  # fmt: skip


@pytest.mark.slow
def test_dpo_tp2_equals_one_process(tmp_path):
    rows = _assert_tp2_equals_one_process(tmp_path, "lora_dpo_distributed", "tiny/lora_dpo")
    assert "rewards/margins" in rows[1] and "logits/chosen" in rows[1]


@pytest.mark.slow
def test_dpo_with_experts_split_equals_one_process(tmp_path):
    # The embedded tiny Mixtral, experts split over the 2 processes (each its own pairs: the
    # one process takes both micro-batches' pairs in one); adapters on attention.
    _assert_tp2_equals_one_process(
        tmp_path, "lora_dpo_distributed", "tiny/lora_dpo", "model.path=${assets:tiny_moe}",
        "lora.targets=[q_proj,k_proj,v_proj,o_proj]", "schedule.batch_size=2",
        split=("parallelism.expert_parallel_size=2",), one=("schedule.batch_size=4",),
    )  # fmt: skip


@pytest.mark.slow
def test_kto_tp2_equals_one_process(tmp_path):
    _assert_tp2_equals_one_process(tmp_path, "kto_distributed", "tiny/kto")


@pytest.mark.slow
def test_reward_model_tp2_equals_one_process(tmp_path):
    # The score head is new (drawn from the seed) and trains whole beside the adapters.
    rows = _assert_tp2_equals_one_process(
        tmp_path, "reward_model_distributed", "tiny/reward_model", "~val_dataset"
    )
    assert "accuracy" in rows[1] and "margin" in rows[1]


@pytest.mark.slow
def test_distillation_tp2_equals_one_process(tmp_path):
    # A random untied Llama of the tiny vocabulary as teacher (a trained one costs an SFT run): its
    # distribution differs from the student's, so the KL and its gradient are not zero.
    pytest.importorskip("transformers")
    teacher = tmp_path / "teacher"
    build_tiny_hf_model("llama3_1", vocab_size=810, bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(teacher)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(assets_dir() / "tiny" / name, teacher / name)
    rows = _assert_tp2_equals_one_process(
        tmp_path, "distill_distributed", "tiny/distill", f"teacher.path={teacher}",
        "model.chunked_output=false", "~val_dataset", "schedule.batch_size=4",
    )  # fmt: skip
    assert rows[1]["scored_tokens"] > 0  # compared above: once per token, as 1 process counts


def test_distillation_refuses_what_tensor_and_expert_parallelism_do_not_cover():
    def problems(**changes):
        settings = dict(
            recipe="distill_distributed", tokenizer=None, dataset=None, optimizer=None,
            output_dir="out", model=LoRAModelSetupArgs(path="student"),
            teacher=TeacherArgs(path="teacher"),
        )  # fmt: skip
        return DistillArgs(**(settings | changes))._parallelism_problems()

    tp2 = ModelParallelismArgs(tensor_parallel_size=2)
    assert problems(parallelism=tp2, model=LoRAModelSetupArgs(path="s", chunked_output=False)) == []  # fmt: skip
    (line,) = problems(parallelism=tp2)
    assert line.startswith("key 'parallelism.tensor_parallel_size': 2 with model.chunked_output: true")  # fmt: skip
    assert line.endswith("set model.chunked_output: false")
    unchunked = LoRAModelSetupArgs(path="s", chunked_output=False)
    (line,) = problems(parallelism=tp2, model=unchunked, teacher=TeacherArgs(path="t", precompute_top_k=True))  # fmt: skip
    assert "teacher.precompute_top_k: true is not built yet" in line
    ep2 = ModelParallelismArgs(expert_parallel_size=2)
    (line,) = problems(parallelism=ep2, on_policy=OnPolicyArgs(lmbda=0.5))
    assert line.startswith("key 'parallelism.expert_parallel_size': 2 with on_policy.lmbda > 0")
    assert problems(parallelism=ep2) == []
