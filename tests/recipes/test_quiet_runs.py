"""Every shipped tiny config runs through the real ``tunelab run`` without a library warning.

Run as a user would, outside make: without ``TORCHAO_FORCE_SKIP_LOADING_SO_FILES`` (the Makefile
and the test suite's conftest set it), so the test proves that tunelab sets what it needs
itself. Any warning line, torchao's ``Failed to load`` or torch's glog-style ``W1203 ...``
fails it, and so do lines of the programs and libraries tunelab calls that are not for the
user (git's ``fatal: not a git repository``, ``datasets``' ``Generating test split`` bars: the
runs start in a folder outside any git repository); tunelab's own ``tunelab: warning: ...``
lines are for the user and allowed.
"""

import re

import pytest

from tests.recipes.conftest import shipped_config_run
from tunelab import _paths

pytestmark = pytest.mark.slow

TINY_CONFIGS = sorted((_paths.configs_dir() / "tiny").glob("*.yaml"))
# A warning from Python's warnings module, torchao's failed kernel loads, torch's C++/glog lines,
# git's complaint outside a repository (lm-eval asks it for a commit), `datasets`' bars.
NOISE = re.compile(
    r"Warning|Failed to load|^(\[rank\d+\]:)?[WE]\d{4} \d|^fatal: |Generating \w+ split",
    re.MULTILINE,
)


@pytest.mark.parametrize("config", TINY_CONFIGS, ids=[path.stem for path in TINY_CONFIGS])
def test_a_shipped_tiny_config_runs_without_library_warnings(config, tmp_path_factory):
    # The run is shared with the old-flat-config test (its migrated twin): made once.
    _, code, output = shipped_config_run(tmp_path_factory, config)
    assert code == 0, output[-4000:]
    noise = [line for line in re.split(r"[\r\n]", output) if NOISE.search(line)]
    assert not noise, "\n".join(noise)
