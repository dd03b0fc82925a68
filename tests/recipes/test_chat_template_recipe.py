"""LoRA on chat data rendered with the tokenizer's own template: real ``tunelab run``, 2 processes.

The embedded tiny tokenizer is given Qwen 2.5's chat template (its ChatML special tokens are in
the tiny vocabulary), so ``template: auto`` renders every conversation as Qwen 2.5 would be
served: the default system prompt, ``<|im_start|>``/``<|im_end|>`` turns.
"""

import math
from pathlib import Path

import pytest

from tests.recipes.conftest import losses_by_step, tunelab_run
from tunelab.checkpoint import verify_folder
from tunelab.cli._data import build_dataset
from tunelab.data import IGNORE_INDEX, load_tokenizer

pytestmark = pytest.mark.slow
QWEN = Path(__file__).resolve().parents[1] / "chat_templates" / "qwen2_5_instruct.jinja"
STEPS = 4
OVERRIDES = [f"tokenizer.chat_template={QWEN}"]


def test_lora_on_chat_data_with_the_qwen_template(tmp_path):
    # What the run trains on: Qwen's format, and every sample has assistant tokens to learn.
    tokenizer, dataset = build_dataset("tiny/chat_lora", OVERRIDES)
    assert tokenizer.chat_template.source == str(QWEN)
    assert dataset.num_truncated == 0
    for index in range(len(dataset)):
        labels = dataset[index]["labels"]
        assert any(label != IGNORE_INDEX for label in labels), index
    first = tokenizer.decode(dataset[0]["tokens"], skip_special_tokens=False)
    assert first.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")

    out = tmp_path / "run"
    tunelab_run(
        "lora_finetune_distributed",
        "tiny/chat_lora",
        f"output_dir={out}",
        *OVERRIDES,
        "schedule.epochs=1",
        f"schedule.max_steps_per_epoch={STEPS}",
        "lr_scheduler.num_warmup_steps=0",
        "checkpoint.save_every_n_steps=2",
        nproc=2,
    )
    losses = losses_by_step(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) and loss > 0 for loss in losses.values())
    assert losses[STEPS] < losses[1]

    export = out / "epoch_0"
    assert (export / "adapter" / "adapter_model.safetensors").is_file()
    assert list(export.glob("model*.safetensors"))
    assert load_tokenizer(export).vocab_size == tokenizer.vocab_size
    # The export is served with the template it was trained on (transformers reads
    # chat_template.jinja before tokenizer_config.json), and the manifest covers the file.
    assert (export / "chat_template.jinja").read_text() == QWEN.read_text()
    assert load_tokenizer(export).chat_template.text == QWEN.read_text()
    assert verify_folder(export) == []
