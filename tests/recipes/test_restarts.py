"""Restarts that resume by themselves: torchrun's ``--max-restarts`` with
``checkpoint.resume_from_checkpoint: auto`` on two loopback nodes.

One worker is killed (SIGKILL) after the first committed step: torchrun restarts the group,
which resumes from the newest committed checkpoint and says ``restart 1 of 2: resumed from
step_K``. Then a worker freezes (SIGSTOP, a hang no signal handler sees): its peer's next
collective times out after ``collective_timeout_s``, that worker fails, and the group restarts
a second time. The run finishes with the losses of an uninterrupted run (fp32, 1e-6).

Before the fix in ``tunelab run`` (a fresh worker store per rendezvous round) the restarted
workers found the dead workers' addresses in the shared store and hung in ``connectFullMesh``.
"""

import json
import re
import signal

import pytest

from tests.recipes.conftest import Nodes, losses_by_step, read_metrics, wait_for
from tests.recipes.test_sft_recipes import COMMON, LORA_GOLDEN, STEPS

pytestmark = pytest.mark.slow
TIMEOUT_S = 180
COLLECTIVE_TIMEOUT_S = 10


def _committed(output_dir, step):
    return (output_dir / f"step_{step}" / "tunelab_manifest.json").is_file()


def _resumed_from(nodes, restart):
    found = re.search(rf"restart {restart} of 2: resumed from step_(\d+)", nodes.output())
    return int(found.group(1)) if found else None


def test_killed_and_hung_workers_restart_and_resume(tmp_path):
    out = tmp_path / "out"
    nodes = Nodes(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", "batch_size=8", *COMMON,
        # A synchronous save after every step: each step is a point to resume from.
        "checkpoint.save_every_n_steps=1", "checkpoint.enable_async_checkpointing=false",
        "checkpoint.resume_from_checkpoint=auto", f"collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
        log_dir=tmp_path, launcher=("--max-restarts", "2"),
        # torchrun waits this long for the frozen worker to obey SIGTERM before SIGKILL.
        env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"},
    )  # fmt: skip
    try:
        wait_for(lambda: _committed(out, 1), TIMEOUT_S, "step_1", nodes)
        for pid in nodes.workers(1):
            os_kill(pid, signal.SIGKILL)
        first = wait_for(lambda: _resumed_from(nodes, 1), TIMEOUT_S, "restart 1", nodes)
        assert first >= 1
        wait_for(lambda: _committed(out, first + 1), TIMEOUT_S, f"step_{first + 1}", nodes)
        for pid in nodes.workers(0):
            os_kill(pid, signal.SIGSTOP)
        nodes.wait(TIMEOUT_S)
    finally:
        nodes.kill()
    second = _resumed_from(nodes, 2)
    assert second is not None and second > first, nodes.output()
    assert "timed out" in nodes.output().lower() or "timeout" in nodes.output().lower()

    losses = losses_by_step(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        assert abs(loss - LORA_GOLDEN[step]) <= 1e-6, (step, loss, LORA_GOLDEN[step])
    # Each step logged once: the records a restarted run repeats were dropped on resume.
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, STEPS + 1))
    manifest = json.loads((out / "epoch_0" / "tunelab_manifest.json").read_text())
    assert manifest


def os_kill(pid, signum):
    import os

    os.kill(pid, signum)
