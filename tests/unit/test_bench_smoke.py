"""Every benchmark script runs to its table at its smallest size (issue 38, finding 11).

``make bench`` is not part of ``make test``, so a benchmark broken by a library change (an
import that moved) went unseen. Each ``bench/bench_*.py`` found by the glob is run here with
``--smoke`` (its smallest sizes, declared in the script: seconds, no timing asserted) as
``make bench`` runs it, in its own processes; a new script is covered without a line here.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(BENCH.glob("bench_*.py"))
# A smoke run takes seconds; this bound only turns a hang into a failure on a loaded machine.
TIMEOUT_S = 600


def test_the_glob_finds_the_benchmarks():
    assert len(SCRIPTS) >= 15, SCRIPTS


def test_make_bench_runs_every_script():
    sys.path.insert(0, str(BENCH))
    try:
        from run_all import BENCHMARKS
    finally:
        sys.path.remove(str(BENCH))
    listed = {entry[0] for entry in BENCHMARKS.values()}
    assert sorted(script.name for script in SCRIPTS) == sorted(listed)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=[script.stem for script in SCRIPTS])
def test_bench_script_runs_to_its_table_in_smoke_mode(script, tmp_path):
    env = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=TIMEOUT_S,
    )
    log = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, f"{script.name} --smoke exited {done.returncode}:\n{log}"
    # print_table's markdown: a heading, the header row, the rule, at least one row.
    assert re.search(r"^### .+\n\n\| figure \|.*\n\|(---\|)+\n\| ", done.stdout, re.M), log
