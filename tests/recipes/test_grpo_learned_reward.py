"""grpo_distributed with a learned reward: tiny/reward_model's export scores the completions.

The reward model is trained here, by the real recipe (tiny/reward_model, 2 processes, a short
run); tiny/grpo_learned_reward then trains the policy against it on 2 processes. The logged
rewards are the reward model's scores (transformers, on the same rendered conversations), and
GRPO raises them.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.recipes.conftest import read_metrics, shared_run
from tunelab._paths import assets_dir
from tunelab.data import load_tokenizer
from tunelab.data.rows import to_messages
from tunelab.data.templates import tokenize_messages

pytestmark = pytest.mark.slow
STEPS = 20


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory) -> tuple[Path, Path]:
    reward_model = shared_run(
        tmp_path_factory, "learned_reward_rm", "reward_model_distributed", "tiny/reward_model",
        "schedule.epochs=1", "schedule.max_steps_per_epoch=60", "schedule.batch_size=2",
        "schedule.run_val_every_n_steps=null", "checkpoint.save_every_n_steps=1000",
    )  # fmt: skip
    folder = reward_model / "epoch_0"
    grpo = shared_run(
        tmp_path_factory, "learned_reward_grpo", "grpo_distributed", "tiny/grpo_learned_reward",
        # Sharded over the 2 processes (auto would replicate this tiny model): the FSDP2 path.
        f"rewards.functions.0.path={folder}", "rewards.functions.0.sharding=shard",
        f"schedule.max_steps_per_epoch={STEPS}",
        "checkpoint.save_every_n_steps=1000",
    )  # fmt: skip
    return folder, grpo


def test_grpo_raises_the_learned_reward(grpo_run):
    _, grpo = grpo_run
    values = [row["rewards/learned_reward"] for row in read_metrics(grpo) if "loss" in row]
    assert len(values) == STEPS
    first, last = sum(values[:5]) / 5, sum(values[-5:]) / 5
    # The scores of this briefly trained reward model are small (~0.3 at the start).
    assert last > first + 0.1, values
    # Logged like any reward, beside the programmatic one it is combined with.
    assert all("rewards/regex_reward" in row for row in read_metrics(grpo) if "loss" in row)


def test_logged_rewards_are_the_reward_models_scores(grpo_run):
    transformers = pytest.importorskip("transformers")
    folder, grpo = grpo_run
    prompts = [
        json.loads(line)["prompt"]
        for line in (assets_dir() / "tiny" / "grpo_prompts.jsonl").read_text().splitlines()
    ]
    records = [json.loads(line) for line in (grpo / "logs" / "completions.jsonl").open()][:12]
    tokenizer = load_tokenizer(folder)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32
    ).eval()
    for record in records:
        prompt = prompts[record["index"]]
        messages = to_messages([("user", prompt), ("assistant", record["completion"])], False)
        tokens, _ = tokenize_messages(tokenizer, messages, "instruct")
        with torch.no_grad():
            score = hf(torch.tensor([tokens])).logits[0, 0].item()
        # The regex reward has weight 0: the total is the learned reward.
        assert record["reward"] == pytest.approx(score, abs=1e-4), record
