"""StepProfiler on a tiny training loop in one process."""

import json
import logging

import pytest
import torch
from torch import nn

from tunelab.config.sections import ProfileArgs
from tunelab.errors import ConfigError
from tunelab.training.profiler import StepProfiler


def _train(profiler: StepProfiler, num_steps: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(num_steps):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        profiler.step()


@pytest.fixture
def log(caplog, monkeypatch):
    # A recipe run in this process may have routed tunelab's records to its own handler.
    monkeypatch.setattr(logging.getLogger("tunelab"), "propagate", True)
    caplog.set_level(logging.INFO, logger="tunelab")
    return caplog


def _step_numbers(trace: dict) -> set[int]:
    # The profiler names each step's span ProfilerStep#i, counting steps from 0.
    return {
        int(event["name"].removeprefix("ProfilerStep#"))
        for event in trace["traceEvents"]
        if event.get("name", "").startswith("ProfilerStep#")
    }


def test_records_the_steps_after_skip_first_into_a_chrome_trace(tmp_path, log):
    profiler = StepProfiler(
        tmp_path / "profile", ProfileArgs(enabled=True, skip_first=2, record_steps=2)
    )
    _train(profiler, 6)
    assert not profiler.enabled  # stopped once written: later steps cost nothing
    profiler.close()
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank_0.json"]
    trace = json.loads((tmp_path / "profile" / "rank_0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::addmm" in names  # the linear layers' forward
    assert _step_numbers(trace) == {2, 3}  # the 3rd and 4th training steps
    assert f"profiled steps 3-4: Chrome traces in {tmp_path / 'profile'}" in log.text


def test_a_run_shorter_than_the_recording_still_writes_its_steps(tmp_path):
    with StepProfiler(
        tmp_path, ProfileArgs(enabled=True, skip_first=1, record_steps=5)
    ) as profiler:
        _train(profiler, 3)
    trace = json.loads(profiler.trace_path.read_text())
    assert {1, 2} <= _step_numbers(trace)


def test_a_run_that_ends_before_recording_says_so(tmp_path, log):
    with StepProfiler(
        tmp_path, ProfileArgs(enabled=True, skip_first=4, record_steps=1)
    ) as profiler:
        _train(profiler, 2)
    assert not (tmp_path / "profile").exists()
    assert "training ended after 2 step(s), before step 5" in log.text


def test_disabled_profiler_does_nothing(tmp_path):
    profiler = StepProfiler(tmp_path, ProfileArgs(enabled=False))
    _train(profiler, 3)
    profiler.close()
    assert not profiler.enabled and not (tmp_path / "profile").exists()


@pytest.mark.parametrize(
    "kwargs, message",
    [({"skip_first": -1}, "skip_first must be 0 or more"), ({"record_steps": 0}, "record_steps")],
)
def test_bad_settings_are_config_errors(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        StepProfiler(tmp_path, ProfileArgs(enabled=True, **kwargs))
