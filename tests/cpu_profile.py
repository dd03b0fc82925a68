"""``pytest --cpu-profile FILE``: each test's CPU seconds, its own and its processes'.

A test's cost here is the CPU time of the pytest process plus that of every child process it
waited for (``RUSAGE_SELF`` + ``RUSAGE_CHILDREN``) from its set-up to its teardown: a launched
``tunelab run`` counts whole, and the figure barely moves with the machine's load, unlike wall
time. One JSON line per test is appended to FILE (``id``, ``self``, ``children``, ``wall``;
xdist workers append to the same file); the run ends with the files that cost most. A fixture
shared by several tests counts in the first test that sets it up.
"""

import collections
import json
import resource
import time
from pathlib import Path

import pytest

_STARTS: dict[str, tuple[float, float, float]] = {}
_PATH: list[str] = []  # the resolved FILE, once configured


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-profile",
        metavar="FILE",
        help="append each test's CPU seconds (own + waited child processes) to FILE as JSONL",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.config.getoption("--cpu-profile"):
        _STARTS[item.nodeid] = (*_cpu(), time.monotonic())


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    start = _STARTS.pop(report.nodeid, None) if report.when == "teardown" else None
    if start is None:
        return
    own, children = _cpu()
    record = {
        "id": report.nodeid,
        "self": round(own - start[0], 3),
        "children": round(children - start[1], 3),
        "wall": round(time.monotonic() - start[2], 3),
    }
    with open(_PATH[0], "a") as out:
        out.write(json.dumps(record) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--cpu-profile")
    if path:
        _PATH[:] = [str(Path(path).resolve())]


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if not _PATH or hasattr(config, "workerinput") or not Path(_PATH[0]).exists():
        return
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for line in Path(_PATH[0]).read_text().splitlines():
        record = json.loads(line)
        totals = by_file[record["id"].split("::")[0]]
        totals[0] += record["self"] + record["children"]
        totals[1] += record["wall"]
        totals[2] += 1
    terminalreporter.section(f"CPU seconds per file (all runs recorded in {_PATH[0]})")
    for name, (cpu, wall, count) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:20]:
        terminalreporter.write_line(f"{cpu:8.1f} CPU-s {wall:8.1f} s wall {count:5d} tests  {name}")
