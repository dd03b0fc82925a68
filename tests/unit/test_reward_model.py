"""Reward models: the Bradley-Terry loss and metrics by hand, last-token scores, margins, PEFT keys."""

import json
import math

import pytest
import torch

from tunelab._paths import assets_dir
from tunelab.data import load_tokenizer, padded_collate_dpo, preference_dataset
from tunelab.errors import DataError
from tunelab.losses.reward import BradleyTerryLoss, reward_metrics
from tunelab.models import from_hf_config
from tunelab.models.classifier import SequenceClassifier, last_token_index, sequence_scores
from tunelab.peft.state import to_peft_state_dict

CHOSEN = torch.tensor([2.0, 0.0, 1.0], dtype=torch.float64)
REJECTED = torch.tensor([0.0, 0.0, 3.0], dtype=torch.float64)


def softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x), written out."""
    return math.log(1.0 + math.exp(x))


def test_bradley_terry_by_hand():
    losses = BradleyTerryLoss()(CHOSEN, REJECTED)
    # -log sigmoid(d) = log(1 + e^-d) for d = 2, 0, -2.
    expected = [softplus(-2.0), math.log(2.0), softplus(2.0)]
    assert losses.tolist() == pytest.approx(expected, abs=1e-12)


def test_bradley_terry_margin_and_centering_by_hand():
    margins = torch.tensor([1.0, -0.5, 0.0], dtype=torch.float64)
    losses = BradleyTerryLoss(center_rewards_coefficient=0.01)(CHOSEN, REJECTED, margins)
    # d - m = 1, 0.5, -2; centering 0.01 * (r_c + r_r)^2 = 0.04, 0, 0.16.
    expected = [softplus(-1.0) + 0.04, softplus(-0.5), softplus(2.0) + 0.16]
    assert losses.tolist() == pytest.approx(expected, abs=1e-12)
    # The mean over pairs is TRL's loss + coefficient * mean((r_c + r_r)^2).
    trl = -torch.nn.functional.logsigmoid(CHOSEN - REJECTED - margins).mean()
    trl = trl + 0.01 * torch.mean((CHOSEN + REJECTED) ** 2)
    assert losses.mean().item() == pytest.approx(trl.item(), abs=1e-12)


def test_negative_centering_refused():
    with pytest.raises(ValueError, match="center_rewards_coefficient"):
        BradleyTerryLoss(center_rewards_coefficient=-0.1)


def test_metrics_by_hand():
    losses = BradleyTerryLoss()(CHOSEN, REJECTED)
    sums = reward_metrics(losses, CHOSEN, REJECTED)
    # A tie (0 vs 0) is not a correct ranking: one of three pairs is right.
    assert sums["accuracy"].item() == 1.0
    assert sums["margin"].item() == pytest.approx(2.0 + 0.0 - 2.0)
    assert sums["rewards/chosen"].item() == 3.0 and sums["rewards/rejected"].item() == 3.0
    assert sums["count"].item() == 3.0
    assert sums["loss"].item() == pytest.approx(losses.sum().item(), abs=1e-12)


def test_last_token_is_the_rightmost_non_pad():
    pad = 2
    tokens = torch.tensor([[5, 6, 7, 2, 2], [5, 2, 7, 8, 9], [5, 6, 2, 2, 2]])
    assert last_token_index(tokens, pad).tolist() == [2, 4, 1]


def test_sequence_scores_read_the_last_token():
    torch.manual_seed(0)
    model = from_hf_config(assets_dir() / "tiny", SequenceClassifier).eval()
    assert not hasattr(model, "lm_head") and model.score.weight.shape == (1, model.args.dim)
    tokens = torch.tensor([[5, 6, 7, 2, 2], [5, 6, 7, 8, 9]])
    with torch.no_grad():
        every = model(tokens)[..., 0]
        scores = sequence_scores(model, tokens, pad_id=2)
        alone = sequence_scores(model, tokens[:1, :3], pad_id=2)
    assert scores.tolist() == [every[0, 2].item(), every[1, 4].item()]
    # Right padding does not change a row's score (causal attention).
    torch.testing.assert_close(alone[0], scores[0], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(assets_dir() / "tiny")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_margin_column_reaches_the_batch(tok, tmp_path):
    rows = [
        {"prompt": "Next number after 41:", "chosen": "42", "rejected": "43", "margin": 1.5},
        {"prompt": "Next number after 11:", "chosen": "12", "rejected": "11", "margin": 0},
    ]
    ds = preference_dataset(
        tok,
        source=write_jsonl(tmp_path / "m.jsonl", rows),
        template="instruct",
        column_map={"margin": "margin"},
    )
    batch = padded_collate_dpo([ds[0], ds[1]], pad_id=tok.pad_id)
    assert batch["margin"].tolist() == [1.5, 0.0]
    # Not named in column_map: the column is not read (the other recipes' data is unchanged).
    plain = preference_dataset(
        tok, source=write_jsonl(tmp_path / "p.jsonl", rows), template="instruct"
    )
    assert "margin" not in padded_collate_dpo([plain[0]], pad_id=tok.pad_id)


@pytest.mark.parametrize("bad", ["1.0", None, float("nan"), True])
def test_bad_margin_names_file_row_and_column(tok, tmp_path, bad):
    good = {"prompt": "Next number after 41:", "chosen": "42", "rejected": "43", "margin": 1}
    path = write_jsonl(tmp_path / "m.jsonl", [good, {**good, "margin": bad}])
    with pytest.raises(DataError, match=r"m\.jsonl:2: row 1 \(0-based\), column 'margin'"):
        preference_dataset(tok, source=path, template="instruct", column_map={"margin": "margin"})


def test_peft_keys_of_a_saved_head():
    state = {
        "model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 4),
        "score.weight": torch.zeros(1, 4),
    }
    keys = set(to_peft_state_dict(state, modules_to_save=["score"]))
    assert keys == {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.score.weight",
    }
    with pytest.raises(Exception, match="not a LoRA adapter weight"):
        to_peft_state_dict(state)
