"""What a GRPO reward may return, and how long it may take (issue 38, findings 3 and 6)."""

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tunelab import ConfigError
from tunelab.errors import TrainingError
from tunelab.rl import Rewards

RELEASE = threading.Event()


def text_scores(prompts, completions, rows):
    return ["1.0" for _ in completions]


def huge(prompts, completions, rows):
    return [1e308, 0.0]


def infinite(prompts, completions, rows):
    return [float("-inf"), 0.0]


def large(prompts, completions, rows):
    return [1e100, 0.0]


def one_string(prompts, completions, rows):
    return "10"


def hangs(prompts, completions, rows):
    RELEASE.wait(30)
    return [0.0 for _ in completions]


def _rewards(*names, **kwargs):
    return Rewards([{"_component_": f"{__name__}.{name}"} for name in names], **kwargs)


def test_a_reward_returning_text_is_refused_naming_it():
    # Before: "1.0" went through float() and trained as 1.0.
    with pytest.raises(
        ConfigError, match=r"reward text_scores returned str '1.0' for completion 0"
    ):
        _rewards("text_scores")(["p", "p"], ["a", "b"], [{}, {}])
    with pytest.raises(ConfigError, match="reward one_string must return a list of numbers"):
        _rewards("one_string")(["p", "p"], ["a", "b"], [{}, {}])


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("huge", r"reward huge returned 1e\+308 for completion 0: beyond \+-1e\+150"),
        ("infinite", r"reward infinite returned a value that is not finite \(-inf for comp"),
    ],
)
def test_an_overflowing_or_infinite_reward_is_named(name, message):
    # Before: 1e308 passed (it is finite) and the step failed later in reward_std.
    with pytest.raises(ConfigError, match=message):
        _rewards(name)(["p", "p"], ["a", "b"], [{}, {}])


def test_a_weighted_sum_past_the_bound_names_the_rewards_and_weights():
    rewards = Rewards(
        [{"_component_": f"{__name__}.large"}, {"_component_": f"{__name__}.large"}],
        [1e60, 0.0],
    )
    with pytest.raises(ConfigError, match=r"the weighted reward 1e\+60 x large_0 \+ 0 x large_1"):
        rewards(["p", "p"], ["a", "b"], [{}, {}])
    from tunelab.rl import MAX_REWARD

    assert MAX_REWARD**2 * 1e8 < 1.7e308  # the bound's reason: 1e8 squares sum finitely


def test_a_hung_reward_ends_after_the_time_limit_naming_it_and_the_rank(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    RELEASE.clear()
    start = time.perf_counter()
    try:
        with pytest.raises(
            TrainingError,
            match=r"reward hangs did not return within rewards\.timeout_s=0.5 s on rank 3",
        ):
            _rewards("hangs", timeout_s=0.5)(["p", "p"], ["a", "b"], [{}, {}])
        assert time.perf_counter() - start < 10
    finally:
        RELEASE.set()


def test_a_hung_reward_does_not_keep_the_process_from_exiting(tmp_path):
    script = textwrap.dedent(
        """
        import time
        from tunelab.errors import TrainingError
        from tunelab.rl import Rewards

        def forever(prompts, completions, rows):
            while True:
                time.sleep(1)

        try:
            Rewards([{"_component_": "__main__.forever"}], timeout_s=0.2)(["p"], ["a"], [{}])
        except TrainingError as error:
            print(error)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "reward forever did not return" in done.stdout
