"""tunelab.rl.learned_reward: a reward-model folder's scores, verified data, clear refusals."""

import json
import shutil

import pytest
import torch

from tunelab._paths import assets_dir
from tunelab.checkpoint.export import export_hf
from tunelab.config.sections import RewardModelSetupArgs
from tunelab.data import load_tokenizer
from tunelab.data.rows import to_messages
from tunelab.data.templates import tokenize_messages
from tunelab.errors import CheckpointError
from tunelab.rl import Rewards, learned_reward
from tunelab.rl.learned_reward import _LOADED
from tunelab.training import build_model

transformers = pytest.importorskip("transformers")
TINY = assets_dir() / "tiny"
ROWS = [
    {"prompt": "Next number after 41:"},
    {"prompt": "Sort the letters: z p s w"},
    {"prompt": "Count the words: car cup dog hill"},
]
COMPLETIONS = ["42", "p s w z and a much longer answer than the others", ""]


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    """A tiny reward model exported by tunelab: fresh seeded head, manifest, tokenizer files."""
    model = build_model(RewardModelSetupArgs(path=str(TINY)), device=torch.device("cpu"), seed=5)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    model.pad_token_id = load_tokenizer(TINY).pad_id
    return export_hf(model, tmp_path_factory.mktemp("rm") / "epoch_0", base_checkpoint_dir=TINY)


def test_scores_equal_transformers_on_the_rendered_conversations(reward_folder):
    _LOADED.clear()
    ours = learned_reward(
        ["unused"] * 3,
        COMPLETIONS,
        ROWS,
        path=str(reward_folder),
        template="instruct",
        batch_size=2,
    )
    tokenizer = load_tokenizer(reward_folder)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        reward_folder, dtype=torch.float32
    ).eval()
    for row, completion, score in zip(ROWS, COMPLETIONS, ours, strict=True):
        messages = to_messages([("user", row["prompt"]), ("assistant", completion)], False)
        tokens, _ = tokenize_messages(tokenizer, messages, "instruct")
        with torch.no_grad():
            expected = hf(torch.tensor([tokens])).logits[0, 0].item()
        assert score == pytest.approx(expected, abs=1e-5)
    assert len(set(ours)) == 3, "three different conversations, three scores"


def test_combines_with_programmatic_rewards_and_loads_once(reward_folder):
    _LOADED.clear()
    node = {"_component_": "tunelab.rl.learned_reward", "path": str(reward_folder)}
    node |= {"template": "instruct"}
    regex = {"_component_": "tunelab.rl.regex_reward", "pattern": "[0-9 ]+"}
    rewards = Rewards([node, regex], [0.5, 2.0], timeout_s=None)
    total, each = rewards(["p"] * 3, COMPLETIONS, ROWS)
    assert list(each) == ["learned_reward", "regex_reward"]
    torch.testing.assert_close(total, 0.5 * each["learned_reward"] + 2.0 * each["regex_reward"])
    rewards(["p"] * 3, COMPLETIONS, ROWS)
    assert len(_LOADED) == 1


def test_a_causal_lm_folder_is_refused(tmp_path):
    _LOADED.clear()
    with pytest.raises(CheckpointError, match="has no score.weight: not a reward model"):
        learned_reward(["p"], ["a"], [{}], path=str(TINY), template="instruct")


def test_a_damaged_folder_is_refused_before_loading(reward_folder, tmp_path):
    _LOADED.clear()
    damaged = shutil.copytree(reward_folder, tmp_path / "damaged")
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails verification: .*model.safetensors"):
        learned_reward(["p"], ["a"], [{}], path=str(damaged), template="instruct")
    assert json.loads((damaged / "config.json").read_text())["num_labels"] == 1
