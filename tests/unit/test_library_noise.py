"""Importing tunelab sets torchao's switch and drops the known library lines, unless asked not to."""

import os
import subprocess
import sys

import pytest

PROBE = """
import logging, os
import tunelab
print(os.environ.get("TORCHAO_FORCE_SKIP_LOADING_SO_FILES"))
logging.getLogger("torch.utils._pytree").warning(
    "%s is an Enum subclass and is now natively supported by torch.compile", "<enum 'X'>"
)
logging.getLogger("torch.utils._pytree").warning("another pytree warning")
"""


def _probe(**extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"}
    env.pop("TUNELAB_SHOW_LIBRARY_WARNINGS", None)
    env.update(extra)
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True
    )


def test_import_sets_the_torchao_switch_and_drops_only_the_known_lines():
    result = _probe()
    assert result.stdout.strip() == "1"
    assert "Enum subclass" not in result.stderr
    assert "another pytree warning" in result.stderr  # Anything else still shows.


@pytest.mark.parametrize(
    ("extra", "switch"),
    [
        ({"TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "0"}, "0"),
        ({"TUNELAB_SHOW_LIBRARY_WARNINGS": "1"}, "None"),
    ],
)
def test_the_environment_wins_and_show_brings_everything_back(extra, switch):
    result = _probe(**extra)
    assert result.stdout.strip() == switch
    shown = "Enum subclass" in result.stderr
    assert shown == ("TUNELAB_SHOW_LIBRARY_WARNINGS" in extra)
