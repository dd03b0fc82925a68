"""DPO on image rows through the real ``tunelab run``: ``lora_dpo_distributed`` on 2 processes
with the embedded tiny Qwen2.5-VL, pairs whose prompt shows one of its generated images and asks
its colour (chosen: the colour; rejected: a refusal), half as content parts and half as an
``images`` column with ``<image>``.

At step 1 the policy is the reference, so the loss is ln 2 to float rounding: both passes read
the same images in the same rows. The run then learns to prefer the answers over the refusal
(the loss falls, the reward margin opens) and exports an adapter. (That the images reach the
log-probs is ``tests/unit/test_image_preference.py``'s: swapping a pair's image moves them.)

For each family (Qwen2.5-VL; Qwen3-VL: deepstack, interleaved M-RoPE; Gemma 3: SigLIP tower,
pooled soft tokens, bidirectional image blocks) one 2-process run serves two checks: one process
with twice the accumulation gives the same losses, and a run killed after step 2's checkpoint
resumes on two processes to the same losses and adapter, bit for bit. The Qwen2.5-VL run also
serves the ln 2 and learning checks.
"""

import json
import math

import pytest

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    losses_by_step,
    read_metrics,
    tunelab_run,
)
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow
TINY_VL = assets_dir() / "tiny_vl"
TINY_GEMMA3_VL = assets_dir() / "tiny_gemma3_vl"
TINY_QWEN3_VL = assets_dir() / "tiny_qwen3_vl"
REFUSAL = "I cannot tell."
EPOCHS = 1
STEPS = EPOCHS * 16 // 4  # 16 pairs, 2 a step on each of 2 processes


def _pairs(path):
    rows = []
    for index, image in enumerate(sorted((TINY_VL / "images").glob("*.png"))):
        colour = image.name.split("_")[0]
        question = "What colour is the shape?"
        if index % 2:
            row = {"prompt": f"<image>{question}", "images": [str(image)]}
        else:
            parts = [{"type": "image", "image": str(image)}, {"type": "text", "text": question}]
            row = {"prompt": [{"role": "user", "content": parts}]}
        rows.append({**row, "chosen": f"{colour.title()}.", "rejected": REFUSAL})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _dpo(out, data, *extra, model=TINY_VL, nproc=2, accumulation=1):
    return tunelab_run(
        "lora_dpo_distributed", "tiny/lora_dpo", f"output_dir={out}",
        f"model.path={model}", "dataset._component_=tunelab.data.image_preference_dataset",
        f"dataset.data_files={data}", "~dataset.template", f"schedule.epochs={EPOCHS}",
        "schedule.max_steps_per_epoch=null", "schedule.batch_size=2",
        f"schedule.gradient_accumulation_steps={accumulation}",
        "lr_scheduler.num_warmup_steps=0", "optimizer.lr=5e-3",
        "checkpoint.enable_async_checkpointing=false", *extra, nproc=nproc,
    )  # fmt: skip


SAVES = ("checkpoint.save_every_n_steps=2", "checkpoint.keep_last_n_checkpoints=null")
MODELS = {"qwen2_5_vl": TINY_VL, "qwen3_vl": TINY_QWEN3_VL, "gemma3": TINY_GEMMA3_VL}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return _pairs(tmp_path_factory.mktemp("vl_dpo_pairs") / "pairs.jsonl")


@pytest.fixture(scope="module", params=sorted(MODELS))
def two_processes(request, tmp_path_factory, pairs):
    out = tmp_path_factory.mktemp(f"vl_dpo_{request.param}") / "2p"
    _dpo(out, pairs, *SAVES, model=MODELS[request.param])
    return out, request.param


@pytest.mark.parametrize("two_processes", ["qwen2_5_vl"], indirect=True)
def test_dpo_on_image_pairs_starts_at_ln2_and_learns(two_processes):
    out, _ = two_processes
    rows = {row["step"]: row for row in read_metrics(out) if "loss" in row}
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert abs(rows[1]["loss"] - math.log(2.0)) <= 1e-6, rows[1]
    assert rows[1]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    late = [rows[step] for step in range(STEPS - 2, STEPS + 1)]
    assert all(row["loss"] < 0.1 and row["rewards/margins"] > 1.0 for row in late), late
    assert all(row["rewards/accuracies"] == 1.0 for row in late), late
    adapter = out / f"epoch_{EPOCHS - 1}" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert not any("visual" in name for name in config["target_modules"])


def test_two_processes_equal_one_with_twice_the_accumulation(two_processes, pairs, tmp_path):
    two_dir, family = two_processes
    _dpo(tmp_path / "1p", pairs, *SAVES, model=MODELS[family], nproc=1, accumulation=2)
    two, one = losses_by_step(two_dir), losses_by_step(tmp_path / "1p")
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    assert abs(two[1] - math.log(2.0)) <= 1e-6, two
    for step in two:
        assert abs(two[step] - one[step]) <= 1e-5, (step, two[step], one[step])
    assert two[STEPS] < two[1]  # it learns


def test_exact_resume_on_two_processes(two_processes, pairs, tmp_path):
    reference_dir, family = two_processes
    out = interrupted_copy(reference_dir, tmp_path / "run", after_step=2)
    _dpo(out, pairs, *SAVES, "checkpoint.resume_from_checkpoint=true", model=MODELS[family])
    resumed, reference = losses_by_step(out), losses_by_step(reference_dir)
    assert sorted(resumed) == [3, 4]
    assert all(resumed[step] == reference[step] for step in (3, 4)), (resumed, reference)
    assert_same_exports(out, reference_dir)
