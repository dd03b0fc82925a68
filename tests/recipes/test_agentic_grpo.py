"""grpo_distributed with an ``agentic`` section: the real ``tunelab run`` of tiny/agentic_grpo.

The policy must call tools for these tests to mean anything, and the embedded tiny model does
not: it is first fully fine-tuned (about a minute on 2 processes) to memorise one tool call
(``count_words`` on "a b"), the tool's result and the answer "2". At temperature 1 its episodes
then call the tool, read the result and answer, with now and then a malformed call (an
unknown tool or bad arguments, which become tool errors). The reward is the answer "2".
Runs are module-scoped and shared between tests.
"""

import json
from pathlib import Path

import pytest

from tests.recipes.conftest import interrupted_copy, read_metrics, tunelab_run
from tunelab.assets import _tools

pytestmark = pytest.mark.slow

PROMPTS = Path(__file__).resolve().parents[2] / "framework/tunelab/assets/tiny/grpo_prompts.jsonl"
STEPS = ("schedule.max_steps_per_epoch=4", "checkpoint.save_every_n_steps=2")
REWARD = (
    "rewards.functions.0._component_=tunelab.rl.regex_reward",
    "~rewards.functions.0.column",
    'rewards.functions.0.pattern="2"',
)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    """The tiny model fully fine-tuned to call ``count_words`` and answer with its result."""
    root = tmp_path_factory.mktemp("agentic")
    data = root / "calls.jsonl"
    call = {"id": "call_0", "type": "function",
            "function": {"name": "count_words", "arguments": json.dumps({"text": "a b"})}}  # fmt: skip
    with data.open("w") as file:
        for line in PROMPTS.read_text().splitlines()[:64]:
            messages = [
                {"role": "user", "content": json.loads(line)["prompt"]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "name": "count_words", "content": "2"},
                {"role": "assistant", "content": "2"},
            ]
            file.write(json.dumps({"tools": _tools.TOOL_SCHEMAS, "messages": messages}) + "\n")
    out = root / "sft"
    tunelab_run(
        "full_finetune_distributed", "tiny/chat_tools_lora", "recipe=full_finetune_distributed",
        "~lora", "~lr_scheduler", f"output_dir={out}", f"dataset.data_files={data}",
        "schedule.epochs=16", "schedule.batch_size=4", "optimizer.lr=3e-3",
        "checkpoint.save_every_n_steps=null", "checkpoint.enable_async_checkpointing=false",
    )  # fmt: skip
    return out / "epoch_15"


def agentic_run(out: Path, model: Path, *overrides: str, nproc: int = 2) -> Path:
    tunelab_run(
        "grpo_distributed", "tiny/agentic_grpo", f"output_dir={out}", f"model.path={model}",
        *REWARD, *overrides, nproc=nproc,
    )  # fmt: skip
    return out


def episodes(out: Path) -> list[dict]:
    return [
        json.loads(line) for line in (out / "logs" / "completions.jsonl").read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, tool_model) -> Path:
    out = tmp_path_factory.mktemp("agentic") / "two"
    return agentic_run(out, tool_model, "schedule.batch_size=2", *STEPS)


def test_episodes_call_tools_and_are_logged_whole(two_processes):
    records = episodes(two_processes)
    assert len(records) == 4 * 4 * 4  # steps x prompts x generations
    with_calls = [r for r in records if r["num_tool_calls"] > 0]
    assert with_calls, "the fine-tuned tiny model calls its tools"
    for record in with_calls:
        roles = [m["role"] for m in record["messages"]]
        assert roles[0] == "user" and roles[1] == "assistant" and "tool" in roles
        assert len(record["trained"]) == len(record["completion_ids"])
        assert not all(record["trained"])  # tool and template tokens are not trained
        result = record["messages"][roles.index("tool")]["content"]
        assert result == "2" or result.startswith("Error: "), result  # the real tool ran
    results = [m["content"] for r in with_calls for m in r["messages"] if m["role"] == "tool"]
    assert results.count("2") > len(results) / 2
    metrics = read_metrics(two_processes)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert m["agentic/turns"] >= 1 and m["agentic/prefill_tokens"] > 0
        assert "agentic/tool_errors/timeout" in m and "agentic/stop/answer" in m
    assert all(m["agentic/tool_calls"] > 0.5 for m in metrics)
    # Each turn prefilled only its new tokens: the prompt (~68) and the tool's delta (~15);
    # prefilling the conversation again at the second turn would add ~130 more.
    for m in metrics:
        assert 60 < m["agentic/prefill_tokens"] < 110


def test_two_processes_equal_one_with_twice_the_batch(two_processes, tool_model, tmp_path):
    one = agentic_run(tmp_path / "one", tool_model, "schedule.batch_size=4", *STEPS, nproc=1)
    key = lambda r: (r["step"], r["index"], r["sample"])  # noqa: E731
    assert sorted(episodes(one), key=key) == sorted(episodes(two_processes), key=key)
    for a, b in zip(read_metrics(one), read_metrics(two_processes), strict=True):
        assert a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)


def test_kill_and_resume_is_exact_with_tool_calls(two_processes, tool_model, tmp_path):
    resumed = interrupted_copy(two_processes, tmp_path / "resumed", after_step=2, keep_logs=True)
    agentic_run(resumed, tool_model, "schedule.batch_size=2", *STEPS,
                "checkpoint.resume_from_checkpoint=true")  # fmt: skip
    ours = (resumed / "logs" / "completions.jsonl").read_text().splitlines()
    assert ours == (two_processes / "logs" / "completions.jsonl").read_text().splitlines()
    after = [m for m in read_metrics(resumed) if m["step"] > 2]
    before = [m for m in read_metrics(two_processes) if m["step"] > 2]
    for a, b in zip(after, before, strict=True):
        assert (a["loss"], a["reward"]) == (b["loss"], b["reward"])
