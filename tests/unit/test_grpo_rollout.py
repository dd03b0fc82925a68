"""GRPO's pieces: the batched rollout engine, sampling seeds, rewards, the prompt dataset."""

from pathlib import Path

import pytest
import torch

from tunelab import ConfigError, DataError
from tunelab.data import load_tokenizer, padded_collate_prompts, prompt_dataset
from tunelab.generation import generate
from tunelab.rl import (
    ModelRolloutEngine,
    Rewards,
    SamplingSettings,
    completion_length_reward,
    completion_logps,
    exact_answer_reward,
    regex_reward,
    rollout_batch,
    sample_tokens,
    sampling_seeds,
)
from tunelab.training import load_model

TINY = Path(__file__).resolve().parents[2] / "framework" / "tunelab" / "assets" / "tiny"
PROMPTS = TINY / "grpo_prompts.jsonl"


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tokenizer = load_tokenizer(str(TINY), max_seq_len=256)
    model = load_model(str(TINY), device=torch.device("cpu"), mesh=None, dtype=torch.float32)
    dataset = prompt_dataset(tokenizer, source="json", data_files=str(PROMPTS), template="instruct")
    return tokenizer, model, dataset


def test_greedy_batched_rollouts_equal_one_prompt_at_a_time(tiny):
    tokenizer, model, dataset = tiny
    prompts = [dataset.tokens[i] for i in (0, 1, 2, 3, 5)]  # lengths differ: padded after
    assert len({len(p) for p in prompts}) > 1
    settings = SamplingSettings(max_new_tokens=10, temperature=0.0, stop_ids=frozenset({1}))
    engine = ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id)
    batched = engine.generate(prompts, seeds=[0] * len(prompts))
    for prompt, completion in zip(prompts, batched, strict=True):
        alone = generate(model, prompt, max_new_tokens=10, stop_ids={1})
        assert completion == alone


def test_sampling_depends_on_the_seed_only_not_the_batch(tiny):
    tokenizer, model, dataset = tiny
    settings = SamplingSettings(max_new_tokens=8, temperature=1.0, top_p=0.95, top_k=50)
    engine = ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id)
    prompts = [dataset.tokens[i] for i in (4, 7, 9, 10)]
    seeds = sampling_seeds(0, 3, [4, 7, 9, 10], 1)
    together = engine.generate(prompts, seeds)
    apart = [engine.generate([p], [s])[0] for p, s in zip(prompts, seeds, strict=True)]
    assert together == apart
    assert engine.generate(prompts[::-1], seeds[::-1]) == together[::-1]
    other = engine.generate(prompts, sampling_seeds(0, 4, [4, 7, 9, 10], 1))
    assert other != together  # another step samples other tokens


def test_sampling_seeds_are_distinct_and_stable():
    seeds = sampling_seeds(0, 0, [3, 4], 4)
    assert len(set(seeds)) == 8
    assert seeds == sampling_seeds(0, 0, [3, 4], 4)
    assert sampling_seeds(0, 0, [4], 4) == seeds[4:]  # a prompt's seeds do not depend on others
    assert all(0 <= s < 2**63 for s in seeds)


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200, 1)
    generators = [torch.Generator().manual_seed(i) for i in range(200)]
    top_k = sample_tokens(logits, SamplingSettings(1, top_k=2), generators)
    assert set(top_k.tolist()) == {0, 1}
    # top_p 0.8: 0.5 + 0.3 reach it, so 0.15 and 0.05 are dropped.
    top_p = sample_tokens(logits, SamplingSettings(1, top_p=0.8), generators)
    assert set(top_p.tolist()) == {0, 1}
    greedy = sample_tokens(logits, SamplingSettings(1, temperature=0.0), generators)
    assert set(greedy.tolist()) == {0}


def test_rollout_batch_labels_completion_tokens_only_and_logps_match_full_logits(tiny):
    tokenizer, model, _ = tiny
    from tunelab.training import output_layer

    batch = rollout_batch([[0, 5, 6], [0, 7]], [[9, 10, 1], [11]], tokenizer.pad_id, "cpu")
    assert batch["tokens"].tolist() == [[0, 5, 6, 9, 10, 1], [0, 7, 11, 2, 2, 2]]
    assert batch["labels"].tolist() == [
        [-100, -100, -100, 9, 10, 1],
        [-100, -100, 11, -100, -100, -100],
    ]
    with torch.no_grad():
        chunked, mask = completion_logps(model, batch, output_layer(model))
        logits = model(batch["tokens"])
    expected = torch.log_softmax(logits[:, :-1].double(), -1).gather(
        -1, batch["tokens"][:, 1:, None]
    )[..., 0]
    assert mask.sum().item() == 4
    torch.testing.assert_close(chunked[mask].double(), expected[mask], atol=1e-5, rtol=0)


def test_rewards_score_weigh_and_name_each():
    rewards = Rewards(
        [
            {"_component_": "tunelab.rl.exact_answer_reward", "column": "answer"},
            {"_component_": "tunelab.rl.regex_reward", "pattern": "[0-9]+"},
        ],
        [1.0, 0.5],
    )
    total, each = rewards(["p", "p"], ["42", " x "], [{"answer": "42"}, {"answer": "y"}])
    assert each["exact_answer_reward"].tolist() == [1.0, 0.0]
    assert each["regex_reward"].tolist() == [1.0, 0.0]
    assert total.tolist() == [1.5, 0.0]
    assert completion_length_reward([], ["abc", "abcdef"], [{}, {}], max_chars=4) == [0.0, -0.02]
    assert exact_answer_reward([], [" a  b "], [{"answer": "a b"}]) == [1.0]
    assert regex_reward([], ["x 1"], [{}], pattern="[0-9]", full_match=False) == [1.0]


def _raises(prompts, completions, rows):
    raise RuntimeError("boom")


def _short(prompts, completions, rows):
    return [1.0]


def _nan(prompts, completions, rows):
    return [float("nan")] * len(completions)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("_raises", "reward _raises raised RuntimeError: boom"),
        ("_short", "reward _short returned 1 values for 2 completions"),
        ("_nan", "reward _nan returned a value that is not finite"),
    ],
)
def test_a_failing_reward_is_one_error_naming_it(name, message):
    rewards = Rewards([{"_component_": f"tests.unit.test_grpo_rollout.{name}"}])
    with pytest.raises(ConfigError, match=message):
        rewards(["p", "p"], ["a", "b"], [{}, {}])


def test_rewards_need_one_weight_each():
    with pytest.raises(ConfigError, match="2 weights for 1 rewards"):
        Rewards([{"_component_": "tunelab.rl.regex_reward"}], [1.0, 2.0])


def test_prompt_dataset_renders_text_and_messages_and_keeps_columns(tmp_path, tiny):
    tokenizer = tiny[0]
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "Count the words: a b", "answer": "2"}\n'
        '{"prompt": [{"role": "user", "content": "Count the words: c"}], "answer": "1"}\n'
    )
    dataset = prompt_dataset(tokenizer, source=str(path), template="auto")
    assert len(dataset) == 2
    assert dataset.rows[1]["answer"] == "1"
    # The chat template's generation prompt ends the rendered prompt.
    expected = tokenizer.chat_template.render(
        [{"role": "user", "content": "Count the words: a b"}], add_generation_prompt=True
    )
    assert dataset.prompts[0] == expected
    batch = padded_collate_prompts([dataset[0], dataset[1]], pad_id=tokenizer.pad_id)
    assert batch["index"].tolist() == [0, 1]
    assert batch["prompt_lengths"].tolist() == [len(dataset.tokens[0]), len(dataset.tokens[1])]
    path.write_text('{"question": "x"}\n')
    with pytest.raises(DataError, match="prompt"):
        prompt_dataset(tokenizer, source=str(path), template="auto")


def test_math_verify_reward_compares_by_value():
    pytest.importorskip("math_verify")
    from tunelab.rl import math_verify_reward

    rows = [{"answer": "Half of it.\n#### 1/2"}] * 3
    scores = math_verify_reward(
        [], ["The answer is $\\frac{1}{2}$", "0.5", "3"], rows, answer_after="####"
    )
    assert scores == [1.0, 1.0, 0.0]


def test_data_preview_shows_the_rendered_prompts():
    import io

    from tunelab.cli._data import preview

    out = io.StringIO()
    preview("tiny/grpo", [], 1, False, out=out)
    text = out.getvalue()
    assert "prompt:" in text and "0 trained" in text
    assert "### Instruction:\nReverse the words: star rain ship cake milk" in text


def test_the_engine_sums_the_policy_entropy_of_the_sampled_positions(tiny):
    tokenizer, model, dataset = tiny
    engine = ModelRolloutEngine(model, SamplingSettings(max_new_tokens=1), pad_id=tokenizer.pad_id)
    prompt = dataset.tokens[0]
    engine.generate([prompt], [0])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([prompt]))[0, -1].double(), -1)
    expected = -(log_probs.exp() * log_probs).sum().item()
    assert engine.last_entropy_sum == pytest.approx(expected, rel=1e-5)
    assert engine.last_generated_tokens == 1


def test_a_stop_string_ends_a_completion_with_the_token_that_completes_it(tiny):
    tokenizer, model, dataset = tiny
    free = ModelRolloutEngine(
        model, SamplingSettings(max_new_tokens=12, temperature=0.0), pad_id=tokenizer.pad_id
    )
    prompt = dataset.tokens[1]
    full = free.generate([prompt], [0])[0]
    text = tokenizer.decode(full)
    # Stop at the text of the first three tokens: the completion ends at the third.
    stop = tokenizer.decode(full[:3]).strip()[-3:]
    assert stop and stop in text
    settings = SamplingSettings(max_new_tokens=12, temperature=0.0, stop_strings=(stop,))
    stopping = ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id, decode=tokenizer.decode)
    short = stopping.generate([prompt, prompt], [0, 1])
    first = next(n for n in range(1, len(full) + 1) if stop in tokenizer.decode(full[:n]))
    assert short == [full[:first]] * 2
    with pytest.raises(ValueError, match="decode"):
        ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id)
