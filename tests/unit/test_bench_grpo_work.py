"""bench_grpo cannot flatter: ratios only for the same work, `met` from the measured ratio (issue 40).

The bench compares tunelab's GRPO step with TRL's; a ratio of two different workloads says
nothing. Both sides sample full-length completions (stop tokens unreachable), so the same work
is the same count of completions and of prompt and completion tokens in every step, which
``work_difference`` checks before ``rows_for`` prints a ratio. The real launches of both sides
run in ``tests/unit/test_bench_smoke.py`` (``--smoke``).
"""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import _grpo_work
        import bench_grpo

        yield bench_grpo, _grpo_work
    finally:
        sys.path.remove(str(BENCH))


SAME = [[(16, 4), (16, 4), (3, 4)]]


def test_the_same_work_in_another_row_order_is_the_same(bench):
    _, work = bench
    assert work.work_difference(SAME, [list(reversed(SAME[0]))]) is None


@pytest.mark.parametrize(
    ("theirs", "said"),
    [
        ([], "tunelab ran 1 steps, TRL 0"),
        ([[(16, 4), (16, 4)]], "step 0: 3 completions against 2"),
        ([[(16, 4), (16, 4), (4, 4)]], "step 0: 35 prompt tokens against 36"),
        ([[(16, 4), (16, 3), (3, 4)]], "step 0: 12 completion tokens against 11"),
        ([[(16, 5), (16, 3), (3, 4)]], "step 0: the same totals, other"),
    ],
)
def test_work_difference_names_the_first_difference(bench, theirs, said):
    _, work = bench
    assert said in work.work_difference(SAME, theirs)


def test_ended_cuts_after_the_first_stop_token(bench):
    _, work = bench
    assert work.ended([5, 6, 1, 2, 2], {1}) == (5, 6, 1)
    assert work.ended([5, 6], {1}) == (5, 6)


def test_the_word_tokenizer_gives_one_id_per_word(bench):
    # Both sides see the prompt as text once (TRL tokenizes it): it must come back as the same
    # ids. With "w1" as EOS, "w17" split into "w1" + "7" (an added token matches inside words).
    _, work = bench
    tokenizer = work.word_tokenizer(300)
    ids = list(range(2, 300))
    text = tokenizer.decode(ids)
    assert tokenizer(text, add_special_tokens=False).input_ids == ids
    assert work.parity_reward([text, "w2 w4", "w3 </s>"]) == [149 / 298, 1.0, 0.0]


def figures(step_s: float, tokens_per_s: float, rss: float) -> dict[str, float]:
    return {
        "step_s": step_s,
        "step_cpu_s": step_s / 4,
        "rollout_s": step_s / 2,
        "update_s": step_s / 2,
        "tokens_per_s": tokens_per_s,
        "peak_rss": rss,
    }


def test_rows_give_ratios_of_the_medians_and_say_no_where_missed(bench):
    bench_grpo, _ = bench
    entry = {
        "tunelab": [
            figures(1.0, 300.0, 90.0),
            figures(2.0, 100.0, 80.0),
            figures(1.0, 200.0, 70.0),
        ],
        "trl": [figures(1.2, 100.0, 100.0), figures(1.2, 100.0, 100.0), figures(1.2, 100.0, 100.0)],
        "difference": None,
    }
    step, cpu, tokens, memory = bench_grpo.rows_for("wide-512", "2x1", entry)
    assert (step.ratio, step.met) == ("1.20x", False)
    # CPU seconds: the same median ratio, and no target of its own.
    assert (cpu.ratio, cpu.met, cpu.tunelab) == ("1.20x", None, "0.250 s")
    assert (tokens.ratio, tokens.met) == ("2.00x", True)
    assert (memory.ratio, memory.met) == ("0.80x", True)
    # The rollout half, medians over the rounds: tunelab's 0.5 s against TRL's 0.6 s.
    assert step.extra[0] == "0.500 s / 0.600 s (1.20x)"
    assert "2 proc x 1 thr" in step.figure


def test_no_ratio_and_no_met_for_different_work(bench):
    bench_grpo, _ = bench
    entry = {
        "tunelab": [figures(0.1, 900.0, 90.0)],
        "trl": [figures(1.0, 100.0, 100.0)],
        "difference": "round 0: step 0: 32 completions against 31",
    }
    step, cpu, tokens, memory = bench_grpo.rows_for("tiny-16", "1x2", entry)
    for row in (step, cpu, tokens):
        assert (row.ratio, row.met) == (bench_grpo.NOT_COMPARABLE, None)
    assert memory.ratio == "0.90x"  # memory is not a ratio of work


def test_a_launch_summary_leaves_the_warm_up_out(bench):
    bench_grpo, _ = bench
    step = {"step_s": 9.0, "rollout_s": 1.0, "update_s": 1.0, "generate_s": 9.0,
            "generated_tokens": 1.0}  # fmt: skip
    timed = [
        dict(step, step_s=s, generate_s=1.0, generated_tokens=t) for s, t in ((1, 10), (3, 30))
    ]
    result = {"steps": [step, *timed], "load_peak_rss": [5.0, 7.0], "peak_rss": [6.0, 4.0]}
    summary = bench_grpo.summary(result)
    assert summary["step_s"] == 2.0
    assert summary["tokens_per_s"] == 20.0
    assert summary["peak_rss"] == 7.0
