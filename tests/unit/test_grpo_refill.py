"""GRPO's dynamic-sampling refill (one process, a fake engine) and greedy validation (tiny model)."""

from functools import partial
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tunelab.data import load_tokenizer, padded_collate_prompts, prompt_dataset
from tunelab.generation import generate
from tunelab.rl import (
    GroupSampler,
    ModelRolloutEngine,
    Rewards,
    RolloutValidation,
    SamplingSettings,
    refill_indices,
    regex_reward,
    sampling_seeds,
)
from tunelab.training import load_model

TINY = Path(__file__).resolve().parents[2] / "framework" / "tunelab" / "assets" / "tiny"
VARIED = {1, 4, 5, 8}  # prompts whose groups get rewards that differ; the others all 0
GROUP = 3


def varied_reward(prompts, completions, rows):
    """The completion's number (its seed's last digits) on a varied row, else 0."""
    return [float(text) if row["varied"] else 0.0 for text, row in zip(completions, rows)]


class SeedEngine:
    """Returns each sequence's seed mod 1000 as its one-token completion."""

    last_generation_seconds = 0.0
    last_entropy_sum = 0.0

    def __init__(self):
        self.calls = []

    def generate(self, prompts, seeds):
        self.calls.append(seeds)
        return [[seed % 1000] for seed in seeds]


class Prompts:
    def __init__(self, num):
        self.tokens = [[5, index + 6] for index in range(num)]
        self.prompts = [f"p{index}" for index in range(num)]
        self.rows = [{"varied": index in VARIED} for index in range(num)]

    def __len__(self):
        return len(self.tokens)


def sampler(engine):
    return GroupSampler(
        engine,
        Rewards([{"_component_": f"{__name__}.varied_reward"}]),
        Prompts(10),
        decode=lambda ids: str(ids[0]),
        pad_id=0,
        num_generations=GROUP,
        seed=7,
        scale_rewards=True,
        dynamic_sampling=True,
        device=torch.device("cpu"),
    )


def kept_groups(scored):
    return [int(s.rollout.keep.view(-1, GROUP)[:, 0].sum()) for s in scored]


@pytest.mark.parametrize("step", [0, 1, 2, 3])
def test_refill_keeps_up_to_the_step_s_groups_in_draw_order(step):
    engine = SeedEngine()
    groups = sampler(engine)
    own = [groups.sample([0, 1, 2], step)]  # 1 of its 3 groups varies
    assert kept_groups(own) == [1]
    refills = groups.refill(own, step, prompts_per_round=2, max_rounds=3)
    # Expected by hand from the drawn prompts: a group counts while the total stays <= 3.
    kept, expected = 1, []
    for refill_round in range(1, 4):
        if kept >= 3:
            break
        drawn = refill_indices(7, step, refill_round, 10, 2)
        flags = [index in VARIED and kept + sum(i in VARIED for i in drawn[: n + 1]) <= 3
                 for n, index in enumerate(drawn)]  # fmt: skip
        expected.append(flags)
        kept += sum(flags)
    got = [s.rollout.keep.view(-1, GROUP)[:, 0].tolist() for s in refills]
    assert got == expected
    assert sum(kept_groups(own + refills)) <= 3
    for number, part in enumerate(refills, start=1):
        assert {r["round"] for r in part.records} == {number}
        assert part.sums["num_sequences"] == GROUP * sum(expected[number - 1])
        assert "reward" not in part.sums  # the reward metrics describe the step's own prompts
    # A refill round's seeds differ from the step's own, for the same prompt too.
    assert sampling_seeds(7, step, [1], GROUP, refill_round=1) != sampling_seeds(7, step, [1], 3)
    # Deterministic: the same step refills the same way (what a resume relies on).
    again = sampler(SeedEngine())
    replay = again.refill([again.sample([0, 1, 2], step)], step, prompts_per_round=2, max_rounds=3)
    assert [s.records for s in replay] == [s.records for s in refills]


def test_refill_stops_after_max_rounds_or_when_full():
    engine = SeedEngine()
    groups = sampler(engine)
    full = [groups.sample([1, 4], 0)]
    assert groups.refill(full, 0, prompts_per_round=2, max_rounds=5) == []
    none_vary = [groups.sample([0, 2], 0)]
    calls = len(engine.calls)
    refills = groups.refill(none_vary, 0, prompts_per_round=1, max_rounds=2)
    assert len(refills) <= 2 and len(engine.calls) - calls == len(refills)


def test_validation_is_greedy_and_draws_no_random_numbers():
    torch.manual_seed(0)
    tokenizer = load_tokenizer(str(TINY), max_seq_len=256)
    model = load_model(str(TINY), device=torch.device("cpu"), mesh=None, dtype=torch.float32)
    data = prompt_dataset(
        tokenizer, source="json", data_files=str(TINY / "grpo_prompts.jsonl"), template="instruct"
    )
    settings = SamplingSettings(max_new_tokens=6, temperature=1.0, stop_ids=frozenset({1}))
    engine = ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id)
    loader = DataLoader(
        data,
        batch_size=2,
        sampler=[3, 5, 8, 9],
        collate_fn=partial(padded_collate_prompts, pad_id=tokenizer.pad_id),
        generator=torch.Generator(),  # as build_dataloader's: iter() draws no global seed
    )
    pattern = {"_component_": "tunelab.rl.regex_reward", "pattern": "[0-9 ]+"}
    validate = RolloutValidation(
        engine,
        Rewards([pattern, {"_component_": "tunelab.rl.completion_length_reward", "max_chars": 4}]),
        loader,
        decode=tokenizer.decode,
        device=torch.device("cpu"),
    )
    state = torch.get_rng_state()
    metrics = validate()
    assert torch.equal(torch.get_rng_state(), state)
    greedy = [generate(model, data.tokens[i], max_new_tokens=6, stop_ids={1}) for i in (3, 5, 8, 9)]
    texts = [tokenizer.decode(c) for c in greedy]
    expected = sum(regex_reward([], texts, [{}] * 4, pattern="[0-9 ]+")) / 4
    assert metrics["val_rewards/regex_reward"] == pytest.approx(expected)
    assert metrics["val_completion_length"] == pytest.approx(sum(map(len, greedy)) / 4)
    assert set(metrics) == {
        "val_reward",
        "val_completion_length",
        "val_rewards/regex_reward",
        "val_rewards/completion_length_reward",
    }
    assert validate() == metrics  # greedy: the same every time


def test_refill_rounds_need_dynamic_sampling_and_val_dataset_validates(tmp_path, monkeypatch):
    from tunelab import ConfigError
    from tunelab.cli._check import check_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="dynamic_sampling_refill_rounds"):
        check_config("tiny/grpo", ["rollout.dynamic_sampling_refill_rounds=2"])
    check_config(
        "tiny/grpo", ["rollout.dynamic_sampling=true", "rollout.dynamic_sampling_refill_rounds=2"]
    )
    val = f"data_files: {TINY / 'grpo_prompts.jsonl'}, template: instruct"
    node = f"val_dataset={{_component_: tunelab.data.prompt_dataset, source: json, {val}}}"
    check_config("tiny/grpo", [node, "schedule.run_val_every_n_steps=5"])
