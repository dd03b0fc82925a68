"""Every shipped tiny config runs through the real ``tunelab run`` without a library warning.

Run as a user would, outside make: without ``TORCHAO_FORCE_SKIP_LOADING_SO_FILES`` (the Makefile
and the test suite's conftest set it), so the test proves that tunelab sets what it needs
itself. Any warning line, torchao's ``Failed to load`` or torch's glog-style ``W1203 ...``
fails it, and so do lines of the programs and libraries tunelab calls that are not for the
user (git's ``fatal: not a git repository``, ``datasets``' ``Generating test split`` bars: the
runs start in a folder outside any git repository); tunelab's own ``tunelab: warning: ...``
lines are for the user and allowed.
"""

import os
import re
import subprocess

import pytest
import yaml

from tests.recipes.conftest import RECIPE_TIMEOUT_S, TUNELAB
from tunelab import _paths

pytestmark = pytest.mark.slow

TINY_CONFIGS = sorted((_paths.configs_dir() / "tiny").glob("*.yaml"))
# A warning from Python's warnings module, torchao's failed kernel loads, torch's C++/glog lines,
# git's complaint outside a repository (lm-eval asks it for a commit), `datasets`' bars.
NOISE = re.compile(
    r"Warning|Failed to load|^(\[rank\d+\]:)?[WE]\d{4} \d|^fatal: |Generating \w+ split",
    re.MULTILINE,
)


def _processes(config_text: str) -> int:
    # Each config's header says how it is launched (`tunelab run --nproc_per_node 2 ...`).
    found = re.search(r"--nproc_per_node (\d+)", config_text)
    return int(found.group(1)) if found else 1


@pytest.mark.parametrize("config", TINY_CONFIGS, ids=[path.stem for path in TINY_CONFIGS])
def test_a_shipped_tiny_config_runs_without_library_warnings(config, tmp_path):
    text = config.read_text()
    recipe = yaml.safe_load(text)["recipe"]
    if recipe == "generate":
        overrides = ["max_new_tokens=4"]
    elif recipe == "eval":
        overrides = [f"output_dir={tmp_path / 'out'}", "limit=2"]
    else:  # One short epoch still validates, saves, exports and finishes like a full run.
        overrides = [
            f"output_dir={tmp_path / 'out'}",
            "schedule.epochs=1",
            "schedule.max_steps_per_epoch=2",
        ]
    nproc = _processes(text)
    launcher = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHAO_")}
    env.pop("PYTHONWARNINGS", None)
    env.pop("TUNELAB_SHOW_LIBRARY_WARNINGS", None)
    env["OMP_NUM_THREADS"] = "1"  # What `tunelab run` sets for torchrun itself; 2 cores here.
    # A new user's empty `datasets` cache: what it prints when it first prepares a dataset.
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets_cache")
    command = [TUNELAB, "run", *launcher, recipe, "--config", f"tiny/{config.stem}", *overrides]
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=RECIPE_TIMEOUT_S, cwd=tmp_path
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    noise = [line for line in re.split(r"[\r\n]", output) if NOISE.search(line)]
    assert not noise, "\n".join(noise)
