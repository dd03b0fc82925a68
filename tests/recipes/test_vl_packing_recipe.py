"""Packed image rows through the real ``tunelab run``: ``tiny/vl_lora`` (Qwen2.5-VL, M-RoPE
positions restarting at each document) and ``tiny/gemma3_vl_lora`` (Gemma 3, bidirectional
attention inside each image) with ``dataset.packed: true``, three or four samples and their
images a pack of 256 tokens. Two processes equal one process with twice the accumulation, and
it learns.
"""

import re

import pytest

from tests.recipes.conftest import losses_by_step, tunelab_run

pytestmark = pytest.mark.slow
STEPS = 4
PACK = 256
# config -> packs of the 32 rows of tiny_vl/chat.jsonl (71-82 tokens each with Qwen's
# template, 56-62 with Gemma 3's)
CONFIGS = {"tiny/vl_lora": 11, "tiny/gemma3_vl_lora": 8}


def _run(config, out, cache, nproc, accumulation):
    return tunelab_run(
        "lora_finetune_distributed", config, f"output_dir={out}",
        "schedule.epochs=1", f"schedule.max_steps_per_epoch={STEPS}",
        "lr_scheduler.num_warmup_steps=0", "checkpoint.save_every_n_steps=100",
        "schedule.batch_size=1", f"schedule.gradient_accumulation_steps={accumulation}",
        "dataset.packed=true", f"dataset.max_seq_len={PACK}", f"tokenizer.max_seq_len={PACK}",
        f"dataset.cache_dir={cache}", nproc=nproc,
    )  # fmt: skip


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_packed_image_rows_on_two_processes_equal_one_with_twice_the_accumulation(config, tmp_path):
    two = _run(config, tmp_path / "2p", tmp_path / "cache", nproc=2, accumulation=1)
    packs = re.search(r"dataset: (\d+) packs", two.stdout + two.stderr)
    assert packs and int(packs[1]) == CONFIGS[config], (two.stdout + two.stderr)[-3000:]
    _run(config, tmp_path / "1p", tmp_path / "cache", nproc=1, accumulation=2)
    two_losses, one_losses = losses_by_step(tmp_path / "2p"), losses_by_step(tmp_path / "1p")
    assert sorted(two_losses) == sorted(one_losses) == list(range(1, STEPS + 1))
    for step in two_losses:
        assert abs(two_losses[step] - one_losses[step]) <= 1e-5, (step, two_losses, one_losses)
    assert two_losses[STEPS] < two_losses[1]  # it learns
