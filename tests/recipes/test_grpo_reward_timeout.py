"""A hung reward ends a real GRPO run with one line naming it and its rank (issue 38, finding 3).

Before ``rewards.timeout_s``, a reward that never returned on one rank left the other ranks
waiting in the next collective for ``collective_timeout_s`` (30 minutes by default), and the
line then named neither the reward nor the rank.
"""

import os
import subprocess
import textwrap
import time

import pytest

from tests.recipes.conftest import RECIPE_TIMEOUT_S, TUNELAB, run_env

pytestmark = pytest.mark.slow

HANGING_REWARD = textwrap.dedent(
    """
    import os
    import time


    def hang_on_rank_1(prompts, completions, rows):
        # Rank 0 scores at once and goes on to the step's collectives; rank 1 never returns.
        if os.environ.get("RANK") == "1":
            while True:
                time.sleep(1)
        return [0.0 for _ in completions]
    """
)


def test_a_hung_reward_stops_the_run_naming_the_reward_and_the_rank(tmp_path):
    (tmp_path / "hanging_reward.py").write_text(HANGING_REWARD)
    command = [
        TUNELAB, "run", "--nproc_per_node", "2", "grpo_distributed", "--config", "tiny/grpo",
        f"output_dir={tmp_path / 'out'}", "schedule.max_steps_per_epoch=2",
        "rewards.functions=[{_component_: hanging_reward.hang_on_rank_1}]", "rewards.weights=null",
        "rewards.timeout_s=2",
    ]  # fmt: skip
    pythonpath = os.environ.get("PYTHONPATH", "")
    start = time.monotonic()
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=run_env(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), pythonpath]))),
        timeout=RECIPE_TIMEOUT_S,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-3000:]
    expected = (
        "reward hang_on_rank_1 did not return within rewards.timeout_s=2 s on rank 1 "
        "(scoring 16 completions)"
    )
    lines = [line for line in result.stderr.splitlines() if "tunelab: error:" in line]
    assert len(lines) == 1 and expected in lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    # Well before the 30-minute collective timeout: the hung reward thread did not hold the
    # worker at exit (the launcher waits for its workers).
    assert elapsed < RECIPE_TIMEOUT_S / 2
