"""reward_model_distributed: the real ``tunelab run`` on 2 processes, its exports and resume.

One LoRA run of tiny/reward_model on 2 processes (batch 4, an async save at step 4, export at
the end) is shared by the tests: 1 process with twice the accumulation gives the same losses;
a copy cut back to step 4 resumes to the same losses and exports bit for bit; transformers'
``AutoModelForSequenceClassification`` loads the merged export with the scores tunelab logged
and computes; PEFT loads the adapter, head included, with the same scores.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    read_metrics,
    shared_run,
    tunelab_run,
)
from tunelab._paths import assets_dir
from tunelab.config.sections import RewardModelSetupArgs
from tunelab.data import load_tokenizer, padded_collate_dpo, preference_dataset
from tunelab.models.classifier import sequence_scores
from tunelab.training import build_model

pytestmark = pytest.mark.slow

TINY = assets_dir() / "tiny"
STEPS, SAVE_AT = 8, 4
RUN = [
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    f"checkpoint.save_every_n_steps={SAVE_AT}",
    "checkpoint.keep_last_n_checkpoints=null",
    "schedule.run_val_every_n_steps=null",
    "lr_scheduler.num_warmup_steps=0",
]


def training_rows(output_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in read_metrics(output_dir) if "loss" in row}


@pytest.fixture(scope="module")
def run_2p(tmp_path_factory) -> Path:
    return shared_run(
        tmp_path_factory, "reward_model_2p", "reward_model_distributed", "tiny/reward_model",
        "schedule.batch_size=4", *RUN,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY)


@pytest.fixture(scope="module")
def val_batch(tokenizer) -> dict[str, torch.Tensor]:
    """8 validation conversations (4 pairs, both sides), right-padded to the longest."""
    pairs = preference_dataset(
        tokenizer, source=str(TINY / "preference_val.jsonl"), template="instruct"
    )
    return padded_collate_dpo([pairs[i] for i in range(4)], pad_id=tokenizer.pad_id)


def tunelab_scores(folder: Path, tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """tunelab's reward model built from an export folder (1 process), scoring ``tokens``."""
    model = build_model(RewardModelSetupArgs(path=str(folder)), device=torch.device("cpu"))
    with torch.no_grad():
        return sequence_scores(model.eval(), tokens, pad_id)


def test_two_processes_equal_one_with_twice_the_accumulation(run_2p, tmp_path):
    one = tmp_path / "one"
    tunelab_run(
        "reward_model_distributed", "tiny/reward_model", f"output_dir={one}",
        "schedule.batch_size=4", "schedule.gradient_accumulation_steps=2", *RUN, nproc=1,
    )  # fmt: skip
    two, single = training_rows(run_2p), training_rows(one)
    assert sorted(two) == sorted(single) == list(range(1, STEPS + 1))
    for step in two:
        for key in ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected"):
            assert two[step][key] == pytest.approx(single[step][key], rel=1e-5, abs=1e-6), (
                step,
                key,
            )
    assert_same_exports(one, run_2p, atol=1e-5)


def test_kill_and_resume_is_exact(run_2p, tmp_path):
    copy = interrupted_copy(run_2p, tmp_path / "resumed", after_step=SAVE_AT)
    tunelab_run(
        "reward_model_distributed", "tiny/reward_model", f"output_dir={copy}",
        "schedule.batch_size=4", *RUN, "checkpoint.resume_from_checkpoint=true",
    )  # fmt: skip
    expected, resumed = training_rows(run_2p), training_rows(copy)
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for step, row in resumed.items():
        assert row["loss"] == expected[step]["loss"], step
    # The score head is saved in the step checkpoint with the adapter: the exports are equal.
    assert_same_exports(copy, run_2p)


def test_transformers_loads_the_export_with_equal_scores(run_2p, tokenizer, val_batch):
    transformers = pytest.importorskip("transformers")
    export = run_2p / "epoch_0"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["num_labels"] == 1 and config["pad_token_id"] == tokenizer.pad_id
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        export, dtype=torch.float32
    ).eval()
    tokens = val_batch["tokens"]
    assert (tokens == tokenizer.pad_id).any(), "the batch should exercise padding"
    with torch.no_grad():
        theirs = hf(tokens).logits[:, 0]
    ours = tunelab_scores(export, tokens, tokenizer.pad_id)
    assert theirs.abs().max() > 1e-3, "a trained head scores away from 0"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_logged_validation_equals_transformers_on_the_export(run_2p, tokenizer):
    """The run's own val_* at its last step are transformers' means over the validation pairs."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        run_2p / "epoch_0", dtype=torch.float32
    ).eval()
    pairs = preference_dataset(
        tokenizer, source=str(TINY / "preference_val.jsonl"), template="instruct"
    )
    # 2 processes x batches of 4 (drop_last), rank r taking pairs r, r + 2, ...: 0..95 are used.
    used = len(pairs) // 8 * 8
    chosen, rejected = [], []
    with torch.no_grad():
        for start in range(0, used, 16):
            batch = padded_collate_dpo(
                [pairs[i] for i in range(start, min(start + 16, used))],
                pad_id=tokenizer.pad_id,
            )
            scores = hf(batch["tokens"]).logits[:, 0]
            half = scores.shape[0] // 2
            chosen.append(scores[:half])
            rejected.append(scores[half:])
    chosen, rejected = torch.cat(chosen).double(), torch.cat(rejected).double()
    logged = [row for row in read_metrics(run_2p) if "val_accuracy" in row][-1]
    assert logged["val_rewards/chosen"] == pytest.approx(chosen.mean().item(), abs=1e-5)
    assert logged["val_margin"] == pytest.approx((chosen - rejected).mean().item(), abs=1e-5)
    assert logged["val_accuracy"] == pytest.approx((chosen > rejected).double().mean().item())


def test_peft_loads_the_adapter_head_included(run_2p, val_batch):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    adapter_dir = run_2p / "epoch_0" / "adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    assert "base_model.model.score.weight" in saved
    tokens = val_batch["tokens"]
    base = transformers.AutoModelForSequenceClassification.from_pretrained(
        TINY, num_labels=1, pad_token_id=2, dtype=torch.float32
    )
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    # PEFT only warns on missing keys: every saved key must have landed in the model.
    loaded = {
        key.replace(".modules_to_save.default", "").replace(".default", "")
        for key in model.state_dict()
    }
    assert set(saved) <= loaded
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(
        run_2p / "epoch_0", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, merged(tokens).logits, rtol=0, atol=1e-5)
