"""bench_grpo gives a ratio only when both sides did the same work (issue 38, finding 12).

The bench compares tunelab's GRPO step with TRL's; a ratio of two different workloads (other
prompts, other completions, other lengths) says nothing. ``work_difference`` compares every
step's prompts and completions token for token, and ``main`` prints no step or generation
ratio when they differ. TRL is not a dev dependency, so the peer here is tunelab itself: the
same settings (same work: a ratio is printed) or one new token at most (different work: none).
"""

import argparse
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_grpo():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_grpo

        yield bench_grpo
    finally:
        sys.path.remove(str(BENCH))


PROMPT_A, PROMPT_B = (0, 5, 6), (0, 7)
SAME = [[(PROMPT_A, (9, 1)), (PROMPT_B, (4, 4, 4))]]


def test_the_same_work_in_another_row_order_is_the_same(bench_grpo):
    assert bench_grpo.work_difference(SAME, [list(reversed(SAME[0]))]) is None


@pytest.mark.parametrize(
    ("theirs", "said"),
    [
        ([], "tunelab ran 1 steps, TRL 0"),
        ([[(PROMPT_A, (9, 1)), ((0, 8), (4, 4, 4))]], "step 0: the prompts differ"),
        ([[(PROMPT_A, (9, 1)), (PROMPT_B, (4, 4))]], "step 0: 5 completion tokens against 4"),
        (
            [[(PROMPT_A, (9, 1)), (PROMPT_B, (4, 5, 4))]],
            "step 0: completion 1 differs from token 1",
        ),
    ],
)
def test_work_difference_names_the_first_difference(bench_grpo, theirs, said):
    assert said in bench_grpo.work_difference(SAME, theirs)


def test_ended_cuts_after_the_first_stop_token(bench_grpo):
    assert bench_grpo.ended([5, 6, 1, 2, 2], {1}) == (5, 6, 1)
    assert bench_grpo.ended([5, 6], {1}) == (5, 6)


def run_main(bench_grpo, monkeypatch, capsys, tmp_path, *, their_max_new_tokens=None) -> str:
    """``bench_grpo.main`` at its smoke size with tunelab standing in for TRL."""

    def peer_steps(args, _scratch):
        peer_args = argparse.Namespace(**vars(args))
        peer_args.max_new_tokens = their_max_new_tokens or args.max_new_tokens
        return bench_grpo.tunelab_steps(peer_args)

    monkeypatch.setattr(bench_grpo, "trl_installed", lambda: True)
    monkeypatch.setattr(bench_grpo, "peer_name", lambda: "tunelab as the peer")
    monkeypatch.setattr(bench_grpo, "trl_steps", peer_steps)
    monkeypatch.setattr(bench_grpo, "trl_logps_peak", bench_grpo.tunelab_logps_peak)
    monkeypatch.setattr(sys, "argv", ["bench_grpo.py", "--smoke", "--dir", str(tmp_path)])
    bench_grpo.main()
    return capsys.readouterr().out


def table_row(output: str, figure: str) -> list[str]:
    line = next(line for line in output.splitlines() if line.startswith(f"| {figure}"))
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.slow
def test_a_ratio_only_for_the_same_work(bench_grpo, monkeypatch, capsys, tmp_path):
    same = run_main(bench_grpo, monkeypatch, capsys, tmp_path, their_max_new_tokens=None)
    assert "both sides generated the same completions" in same
    for figure in ("step time", "generation tokens/s"):
        assert table_row(same, figure)[3].endswith("x"), same

    other = run_main(bench_grpo, monkeypatch, capsys, tmp_path, their_max_new_tokens=1)
    assert "no step or generation ratio: TRL and tunelab did not do the same work" in other
    for figure in ("step time", "generation tokens/s"):
        assert table_row(other, figure)[3] == bench_grpo.NOT_COMPARABLE, other
    # The log-prob pass runs the same synthetic row on both sides: its ratio stays.
    assert table_row(other, "log-prob pass")[3].endswith("x"), other
