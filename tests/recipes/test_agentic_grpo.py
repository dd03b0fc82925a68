"""grpo_distributed with an ``agentic`` section: the real ``tunelab run`` of tiny/agentic_grpo.

The policy is the shipped first stage, tiny/agentic_sft (a brief full fine-tune, about a minute
on 2 processes): asked ``What is a + b?`` it answers at once about half the time (wrong: the
tiny model cannot add) and otherwise calls the calculator, with calls that now and then break
(a slip in the 70-token call). The reward is the exact answer plus half a point for a call the
calculator ran. One 8-step run is shared by the tests: its reward rises while the same run with
lr 1e-12 stays where it started; it logs whole episodes; its first two steps equal one process
with twice the batch or twice the accumulation; a kill-and-resume at step 4 replays it exactly,
tool calls included. Plain function tools run in worker processes: a hung or crashing calculator
is killed and read as its error (one more 2-step run). Asynchronous GRPO over episodes
(``rollout.mode: async``, colocated): k = 0 is synchronous agentic GRPO bit for bit; with k = 1
two runs are identical and a run whose rank 1 is SIGKILLed after a checkpoint resumes to the
uninterrupted run, the episodes in flight restored (4-step runs). The same episodes rolled out on
a sampling thread (``rollout.overlap``; SIGKILLed and resumed, its in-flight episodes equal the
plain run's), on a rollout rank (1 trainer + 1 rollout rank = 1 colocated process, whose
step_2 resumes on split ranks exactly) and with refill rounds on two rollout ranks (4
processes) give the colocated run's results; episodes rolled out with the weights gathered per
forward (``rollout.gather_once: false``, ranks in lockstep) equal those with the weights held.
"""

import json
import os
import statistics
import subprocess
import zlib
from pathlib import Path

import pytest

from tests.recipes.conftest import (
    RECIPE_TIMEOUT_S,
    TUNELAB,
    assert_same_exports,
    interrupted_copy,
    read_metrics,
    run_env,
    tunelab_run,
)
from tests.recipes.test_grpo import assert_step_logs_equal, sigkill_rank_1
from tests.recipes.test_grpo_async import in_flight_after_the_kill
from tunelab.rl.agentic import calculator

pytestmark = pytest.mark.slow

STEPS = ("schedule.max_steps_per_epoch=8", "checkpoint.save_every_n_steps=4")
PROMPT_TOKENS = 43  # the rendered prompt: the tools line, the question, the generation prompt


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> Path:
    """tiny/agentic_sft as shipped (its last epoch is what tiny/agentic_grpo starts from)."""
    out = tmp_path_factory.mktemp("agentic") / "sft"
    tunelab_run(
        "full_finetune_distributed", "tiny/agentic_sft", f"output_dir={out}",
        "checkpoint.enable_async_checkpointing=false",
    )  # fmt: skip
    return out / "epoch_4"


def agentic_run(out: Path, model: Path, *overrides: str, nproc: int = 2) -> Path:
    tunelab_run(
        "grpo_distributed", "tiny/agentic_grpo", f"output_dir={out}", f"model.path={model}",
        *overrides, nproc=nproc,
    )  # fmt: skip
    return out


def episodes(out: Path) -> list[dict]:
    return [
        json.loads(line) for line in (out / "logs" / "completions.jsonl").read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, sft_model) -> Path:
    out = tmp_path_factory.mktemp("agentic") / "two"
    return agentic_run(out, sft_model, *STEPS)


def test_the_reward_rises_and_not_with_lr_zero(two_processes, sft_model, tmp_path):
    frozen = agentic_run(
        tmp_path / "frozen", sft_model, "schedule.max_steps_per_epoch=8",
        "checkpoint.save_every_n_steps=null", "optimizer.lr=1e-12",
    )  # fmt: skip
    learned, still = read_metrics(two_processes), read_metrics(frozen)
    assert learned[0]["reward"] == still[0]["reward"]  # one policy, the same first episodes

    def mean(metrics: list[dict], key: str) -> float:
        return statistics.mean(m[key] for m in metrics)

    # Measured (2 processes, load ~19): reward over steps 1-2 / 5-8: 0.21 / 0.33 learning, 0.20
    # / 0.19 with lr 1e-12; calls per episode over steps 5-8: 0.79 / 0.42 (the policy learns to
    # call the calculator instead of guessing). A step's reward varies by ~0.03 (64 episodes).
    assert mean(learned[4:], "reward") > mean(still[4:], "reward") + 0.07, (learned, still)
    assert mean(learned[4:], "reward") > mean(learned[:2], "reward") + 0.07, learned
    assert abs(mean(still[4:], "reward") - mean(still[:2], "reward")) < 0.06, still
    calls = "agentic/tool_calls"
    assert mean(learned[4:], calls) > mean(still[4:], calls) + 0.15, (learned, still)


def test_episodes_call_the_calculator_and_are_logged_whole(two_processes):
    records = episodes(two_processes)
    assert len(records) == 8 * 8 * 8  # steps x prompts x generations
    with_calls = [r for r in records if r["num_tool_calls"] > 0]
    assert len(with_calls) > len(records) / 4
    for record in with_calls:
        roles = [m["role"] for m in record["messages"]]
        assert roles[0] == "user" and roles[1] == "assistant" and "tool" in roles
        assert len(record["trained"]) == len(record["completion_ids"])
        call = record["messages"][1]["tool_calls"][0]["function"]
        result = record["messages"][roles.index("tool")]["content"]
        if record["tool_results_cut"]:  # an error message cut to max_tool_result_tokens (24)
            assert result.startswith("Error: ") and result.endswith(" [...]"), result
        if all(record["trained"]):  # the result's delta did not fit: the episode ended there
            assert record["stop_reason"] == "max_episode_tokens" and record["num_turns"] == 1
        if call["name"] == "calculator" and not result.startswith("Error: "):
            assert result == calculator(**call["arguments"])  # the real tool ran
    # Measured: 0 of 356 episodes with a call ended before their result was shown, 49 with a
    # cut error message (before the cut, such episodes all ended unseen at 112 tokens).
    unseen = [r for r in with_calls if all(r["trained"])]
    assert len(unseen) <= len(with_calls) / 20, len(unseen)
    assert any(r["tool_results_cut"] for r in with_calls)
    results = [m["content"] for r in with_calls for m in r["messages"] if m["role"] == "tool"]
    assert sum(not text.startswith("Error: ") for text in results) > len(results) / 2
    metrics = read_metrics(two_processes)
    assert [m["step"] for m in metrics] == list(range(1, 9))
    for m in metrics:
        assert m["agentic/turns"] >= 1 and m["entropy"] > 0
        assert "agentic/tool_errors/timeout" in m and "agentic/stop/answer" in m
        # Each turn prefilled only its new tokens: the prompt, then each result's 14-token
        # delta (the reply's stop token, the tool turn, the generation prompt; an error
        # message is longer). Prefilling the conversation again at the second turn would add
        # the prompt and the ~70-token call (> 110 per turn).
        errors = sum(v for k, v in m.items() if k.startswith("agentic/tool_errors/"))
        bound = PROMPT_TOKENS + 15 * (m["agentic/turns"] - 1) + 60 * errors
        assert PROMPT_TOKENS <= m["agentic/prefill_tokens"] <= bound


@pytest.mark.parametrize(
    "layout",
    ["schedule.batch_size=8", "schedule.gradient_accumulation_steps=2"],
    ids=["twice_the_batch", "twice_the_accumulation"],
)
def test_two_processes_equal_one(two_processes, sft_model, tmp_path, layout):
    one = agentic_run(
        tmp_path / "one", sft_model, layout, "schedule.max_steps_per_epoch=2",
        "checkpoint.save_every_n_steps=null", nproc=1,
    )  # fmt: skip
    key = lambda r: (r["step"], r["index"], r["sample"])  # noqa: E731
    two = [r for r in episodes(two_processes) if r["step"] <= 2]
    assert sorted(episodes(one), key=key) == sorted(two, key=key)
    for a, b in zip(read_metrics(one), read_metrics(two_processes)[:2], strict=True):
        assert a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)


def test_kill_and_resume_is_exact_with_tool_calls(two_processes, sft_model, tmp_path):
    resumed = interrupted_copy(two_processes, tmp_path / "resumed", after_step=4, keep_logs=True)
    agentic_run(resumed, sft_model, *STEPS, "checkpoint.resume_from_checkpoint=true")
    ours = (resumed / "logs" / "completions.jsonl").read_text().splitlines()
    assert ours == (two_processes / "logs" / "completions.jsonl").read_text().splitlines()
    after = [m for m in read_metrics(resumed) if m["step"] > 4]
    before = [m for m in read_metrics(two_processes) if m["step"] > 4]
    for a, b in zip(after, before, strict=True):
        assert (a["loss"], a["reward"]) == (b["loss"], b["reward"])


def test_hung_and_crashing_tools_are_killed_and_read_as_errors(sft_model, tmp_path):
    """tests.agentic_tool_faults.calculator: by a checksum of the call, a third of the calls
    never return and a third kill their worker process (os._exit): 2 real steps go on."""
    out = tmp_path / "faults"
    command = [
        TUNELAB, "run", "--nproc_per_node", "2", "grpo_distributed", "--config", "tiny/agentic_grpo",
        f"output_dir={out}", f"model.path={sft_model}", "schedule.max_steps_per_epoch=2",
        "checkpoint.save_every_n_steps=null", "agentic.tool_timeout_s=1",
        "agentic.max_tool_result_tokens=256",  # the whole messages in completions.jsonl
        "agentic.tools=[{_component_: tests.agentic_tool_faults.calculator}]",
    ]  # fmt: skip
    root = str(Path(__file__).resolve().parents[2])
    pythonpath = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        command, capture_output=True, text=True, env=run_env(PYTHONPATH=pythonpath),
        timeout=RECIPE_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    kinds = {0: 0, 1: 0, 2: 0}
    for record in episodes(out):
        messages = record["messages"]
        for at, reply in enumerate(messages):
            calls = reply.get("tool_calls") or []
            for call, answer in zip(calls, messages[at + 1 : at + 1 + len(calls)], strict=False):
                expression = call["function"]["arguments"].get("expression")
                if call["function"]["name"] != "calculator" or not isinstance(expression, str):
                    continue  # refused before the tool ran (unknown tool, bad arguments)
                fault = zlib.crc32(expression.encode()) % 3
                kinds[fault] += 1
                expected = {
                    0: "Error: calculator took longer than 1 s (stopped)",
                    1: "Error: calculator crashed: its worker process exited with status 1",
                }.get(fault)
                if expected is None:
                    try:
                        expected = calculator(expression)
                    except ValueError:
                        assert answer["content"].startswith("Error: calculator raised ValueError")
                        continue
                assert answer["content"] == expected, (expression, answer)
    assert min(kinds.values()) >= 2, kinds  # every kind of call happened
    metrics = read_metrics(out)
    assert sum(m["agentic/tool_errors/timeout"] for m in metrics) > 0
    assert sum(m["agentic/tool_errors/crash"] for m in metrics) > 0


# -- asynchronous GRPO over episodes (rollout.mode async, colocated) --------------------------

# k = 1: the episodes of step s + 1 sampled by the policy of step s; step_2 holds step 3's.
ASYNC = (
    "rollout.mode=async",
    "rollout.max_lag=1",
    "schedule.max_steps_per_epoch=4",
    "checkpoint.save_every_n_steps=2",
)
TIMINGS = ("tokens_per_second", "generation_tokens_per_second", "train_tokens_per_second",
           "off_policy/sample_seconds", "peak_memory_gib", "agentic/generation_seconds",
           "agentic/tool_seconds", "agentic/tools_wall_seconds")  # fmt: skip


def untimed(output_dir: Path) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMINGS} for m in read_metrics(output_dir)]


def test_async_lag_zero_is_synchronous_agentic_grpo_bit_for_bit(sft_model, tmp_path):
    steps = ("schedule.max_steps_per_epoch=2", "checkpoint.save_every_n_steps=null")
    sync = agentic_run(tmp_path / "sync", sft_model, *steps)
    lag_zero = agentic_run(
        tmp_path / "k0", sft_model, *steps, "rollout.mode=async", "rollout.max_lag=0"
    )
    assert (sync / "logs/completions.jsonl").read_bytes() == (
        lag_zero / "logs/completions.jsonl"
    ).read_bytes()
    ours = untimed(lag_zero)
    assert ours == untimed(sync)  # loss, grad_norm, off_policy/*: every number equal
    assert [m["off_policy/lag"] for m in ours] == [0, 0]
    # Episodes with tool results: the recorded log-probs of the policy's tokens are the
    # trainer's up to rounding (KL ~1e-13 measured), the tool tokens masked out (had they
    # been compared, at log-prob 0 recorded, the KL would be of order 1).
    assert all(m["agentic/tool_calls"] > 0.2 for m in ours)
    assert all(0 <= m["off_policy/kl"] < 1e-9 for m in ours)
    assert all(m["off_policy/clip_fraction"] == 0 for m in ours)
    assert_same_exports(lag_zero, sync)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, sft_model) -> Path:
    return agentic_run(tmp_path_factory.mktemp("agentic_async") / "full", sft_model, *ASYNC)


def test_async_episodes_follow_the_schedule_and_two_runs_are_identical(
    async_run, sft_model, tmp_path
):
    metrics = untimed(async_run)
    assert [m["off_policy/lag"] for m in metrics] == [0, 1, 1, 1]
    assert metrics[0]["off_policy/kl"] < 1e-9
    # Lagged episodes: the policy moved (lr 2e-3), the trainer and behaviour log-probs differ
    # (measured 8e-4 to 2.4e-3), within what a lag of one update should cost.
    assert all(1e-6 < m["off_policy/kl"] < 0.05 for m in metrics[1:])
    assert all(m["agentic/tool_calls"] > 0.2 for m in metrics)
    again = agentic_run(tmp_path / "again", sft_model, *ASYNC)
    assert (again / "logs/completions.jsonl").read_bytes() == (
        async_run / "logs/completions.jsonl"
    ).read_bytes()
    assert untimed(again) == metrics
    assert_same_exports(again, async_run)


def test_async_sigkill_after_a_checkpoint_then_resume_equals_the_uninterrupted_run(
    async_run, sft_model, tmp_path
):
    """Rank 1 SIGKILLed in step 3 (step_2 committed, step 3's episodes in flight); resumed."""
    out = tmp_path / "killed"
    command = [TUNELAB, "run", "--nproc_per_node", "2", "grpo_distributed", "--config",
               "tiny/agentic_grpo", f"output_dir={out}", f"model.path={sft_model}", *ASYNC]  # fmt: skip
    assert sigkill_rank_1(command, out, at_step=3, printed=tmp_path / "killed.out") != 0
    (batch,) = in_flight_after_the_kill(out, committed=2)
    assert (batch["step"], batch["behaviour_step"]) == (2, 1)  # 0-based: step 3, policy of 2
    # The episodes themselves, tool results and recorded log-probs included.
    (part,) = batch["parts"]
    assert any(r["num_tool_calls"] for r in part["records"])
    assert part["behaviour_logps"] is not None
    agentic_run(out, sft_model, *ASYNC, "checkpoint.resume_from_checkpoint=true")
    assert_step_logs_equal(out, async_run)
    after = [m for m in untimed(out) if m["step"] > 2]
    assert after == [m for m in untimed(async_run) if m["step"] > 2]
    assert_same_exports(out, async_run)


# -- episodes on the sampling thread (rollout.overlap) and on rollout ranks (rollout.ranks) ---

TIMED_PARTS = ("generation_seconds", "agentic/generation_seconds", "agentic/tool_seconds",
               "agentic/tools_wall_seconds")  # fmt: skip


def untimed_in_flight(batch: dict) -> dict:
    """A batch in flight without its rollout timings (every token, log-prob and record kept)."""
    parts = [
        {**part, "sums": {k: v for k, v in part["sums"].items() if k not in TIMED_PARTS}}
        for part in batch["parts"]
    ]
    return {**batch, "parts": parts}


def test_overlap_episodes_killed_and_resumed_equal_the_colocated_run(
    async_run, sft_model, tmp_path
):
    """rollout.overlap: a worker thread rolls the episodes out on a whole copy of the model,
    calling tools, while each step trains (its episode loop runs no collective beside the
    training's). Rank 1 SIGKILLed in step 3 (step_2 committed, step 3's episodes sampled on the
    thread in flight), then resumed with the overlap: every step equals the plain colocated run
    (steps 1-2 logged before the kill, 3-4 after the resume)."""
    overlap = (*ASYNC, "rollout.overlap=true")
    out = tmp_path / "overlap"
    command = [TUNELAB, "run", "--nproc_per_node", "2", "grpo_distributed", "--config",
               "tiny/agentic_grpo", f"output_dir={out}", f"model.path={sft_model}", *overlap]  # fmt: skip
    assert sigkill_rank_1(command, out, at_step=3, printed=tmp_path / "killed.out") != 0
    (batch,) = in_flight_after_the_kill(out, committed=2)
    # The episodes in flight are the colocated run's, token for token (tool results, recorded
    # log-probs, advantages and counts included).
    state = json.loads((async_run / "step_2" / "trainer_state.json").read_text())
    (theirs,) = json.loads(json.loads(state["progress"]["rollouts_in_flight"])[0])
    assert untimed_in_flight(batch) == untimed_in_flight(theirs)
    assert any(r["num_tool_calls"] for r in batch["parts"][0]["records"])
    agentic_run(out, sft_model, *overlap, "checkpoint.resume_from_checkpoint=true")
    assert_step_logs_equal(out, async_run)  # completions.jsonl line for line, steps 1-4
    assert untimed(out) == untimed(async_run)  # loss, grad_norm, off_policy/*, agentic/*
    assert_same_exports(out, async_run)


def test_episodes_on_a_rollout_rank_equal_the_colocated_run_with_as_many_trainers(
    sft_model, tmp_path
):
    """rollout.ranks 1 on 2 processes (1 trainer, 1 rollout rank rolling out its episodes and
    calling the tools) equals the colocated async run on 1 process: the same episodes, every
    untimed metric and the exports. The episodes cross the channel as the in-flight record;
    the colocated run's step_2 (step 3's episodes in flight) resumed on split ranks ends as
    the split run."""
    split = agentic_run(tmp_path / "split", sft_model, *ASYNC, "rollout.ranks=1")
    colocated = agentic_run(tmp_path / "colocated", sft_model, *ASYNC, nproc=1)

    def assert_same_run(ours: Path, theirs: Path) -> None:
        assert (ours / "logs/completions.jsonl").read_bytes() == (
            theirs / "logs/completions.jsonl"
        ).read_bytes()
        without_transfers = [
            {k: v for k, v in m.items() if not k.startswith("async/")} for m in untimed(ours)
        ]
        assert without_transfers == [
            {k: v for k, v in m.items() if not k.startswith("async/")} for m in untimed(theirs)
        ]
        assert_same_exports(ours, theirs)

    assert_same_run(split, colocated)
    metrics = untimed(split)
    assert [m["off_policy/lag"] for m in metrics] == [0, 1, 1, 1]
    assert all(m["agentic/tool_calls"] > 0.2 for m in metrics)
    # The adapter: policies 0 and 1 in step 1, 2 in step 2 (the later ones sample nothing).
    sent = [m["async/weight_transfer_bytes"] for m in metrics]
    assert sent[0] == 2 * sent[1] > 0 and sent[2:] == [0, 0], sent
    resumed = interrupted_copy(colocated, tmp_path / "resumed", after_step=2, keep_logs=True)
    agentic_run(
        resumed, sft_model, *ASYNC, "rollout.ranks=1", "checkpoint.resume_from_checkpoint=true"
    )
    assert_same_run(resumed, split)  # steps 1-2 logged once by the colocated run


def test_refill_rounds_of_episodes_on_two_rollout_ranks_equal_the_colocated_ones(
    sft_model, tmp_path
):
    """2 trainers + 2 rollout ranks, dynamic sampling with refill rounds (the rollout ranks
    agree on the refills over their own group, each rolling out and calling tools for one
    trainer) = colocated async on 2 processes: the same episodes, metrics and exports."""
    # Groups of 2 episodes: often equal rewards, so refills are needed.
    refill = (*ASYNC[:2], "rollout.dynamic_sampling=true", "rollout.num_generations=2",
              "rollout.dynamic_sampling_refill_rounds=2", "schedule.max_steps_per_epoch=2",
              "checkpoint.save_every_n_steps=null")  # fmt: skip
    split = agentic_run(tmp_path / "split", sft_model, *refill, "rollout.ranks=2", nproc=4)
    colocated = agentic_run(tmp_path / "colocated", sft_model, *refill)
    assert (split / "logs/completions.jsonl").read_bytes() == (
        colocated / "logs/completions.jsonl"
    ).read_bytes()

    def without_transfers(out: Path) -> list[dict]:
        return [{k: v for k, v in m.items() if not k.startswith("async/")} for m in untimed(out)]

    assert without_transfers(split) == without_transfers(colocated)
    assert_same_exports(split, colocated)
    records = episodes(split)
    assert max(record.get("round", 0) for record in records) > 0  # refill rounds ran
    assert any(record["num_tool_calls"] > 0 for record in records)  # the rollout ranks' tools


def test_episodes_with_weights_gathered_per_forward_equal_those_with_weights_held(
    sft_model, tmp_path
):
    """rollout.gather_once false: the adapters stay sharded DTensors while the episodes roll
    out, so every forward all-gathers and the ranks take their turns in lockstep (a rank
    whose episodes ended keeps stepping until every rank's have); the episodes, metrics and
    exports equal the run that holds the weights gathered (both unmerged: merging rounds).
    The unit test of the loop counts its all-reduces."""
    short = ("schedule.max_steps_per_epoch=2", "checkpoint.save_every_n_steps=null",
             "rollout.merge_adapters=false")  # fmt: skip
    lockstep = agentic_run(tmp_path / "lockstep", sft_model, *short, "rollout.gather_once=false")
    held = agentic_run(tmp_path / "held", sft_model, *short)
    assert (lockstep / "logs/completions.jsonl").read_bytes() == (
        held / "logs/completions.jsonl"
    ).read_bytes()
    assert untimed(lockstep) == untimed(held)
    assert_same_exports(lockstep, held)
    # Episodes of one and of two turns: ranks step on while their own episodes have ended.
    assert {1, 2} <= {record["num_turns"] for record in episodes(lockstep)}
