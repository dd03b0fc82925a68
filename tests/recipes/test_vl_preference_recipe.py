"""DPO on image rows through the real ``tunelab run``: ``lora_dpo_distributed`` on 2 processes
with the embedded tiny Qwen2.5-VL, pairs whose prompt shows one of its generated images and asks
its colour (chosen: the colour; rejected: a refusal), half as content parts and half as an
``images`` column with ``<image>``.

At step 1 the policy is the reference, so the loss is ln 2 to float rounding: both passes read
the same images in the same rows. The run then learns to prefer the answers over the refusal
(the loss falls, the reward margin opens) and exports an adapter. (That the images reach the
log-probs is ``tests/unit/test_image_preference.py``'s: swapping a pair's image moves them.)
"""

import json
import math

import pytest

from tests.recipes.conftest import read_metrics, tunelab_run
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow
TINY_VL = assets_dir() / "tiny_vl"
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


def test_dpo_on_image_pairs_starts_at_ln2_and_learns(tmp_path):
    data = _pairs(tmp_path / "pairs.jsonl")
    out = tmp_path / "run"
    tunelab_run(
        "lora_dpo_distributed", "tiny/lora_dpo", f"output_dir={out}",
        f"model.path={TINY_VL}", "dataset._component_=tunelab.data.image_preference_dataset",
        f"dataset.data_files={data}", "~dataset.template", f"schedule.epochs={EPOCHS}",
        "schedule.max_steps_per_epoch=null", "schedule.batch_size=2",
        "lr_scheduler.num_warmup_steps=0", "optimizer.lr=5e-3",
        "checkpoint.save_every_n_steps=null", "checkpoint.enable_async_checkpointing=false",
    )  # fmt: skip
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
