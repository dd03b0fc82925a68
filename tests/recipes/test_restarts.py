"""Restarts that resume by themselves: torchrun's ``--max-restarts`` with
``checkpoint.resume_from_checkpoint: auto`` on two loopback nodes.

One worker is killed (SIGKILL) after the first committed step: torchrun restarts the group,
which resumes from the newest committed checkpoint and says ``restart 1 of 2: resumed from
step_K``. Then a worker freezes (SIGSTOP, a hang no signal handler sees): its peer's next
collective times out after ``collective_timeout_s``, that worker fails, and the group restarts
a second time (torchrun SIGKILLs the frozen worker 30 s later; the test does it at once). The
run finishes with the losses of an uninterrupted run (the 2-process reference; fp32, 1e-6),
each step logged once.

Before the fix in ``tunelab run`` (a fresh worker store per rendezvous round) the restarted
workers found the dead workers' addresses in the shared store and hung in ``connectFullMesh``.
"""

import os
import re
import signal
import time

import pytest

from tests.recipes.conftest import COMMON, STEPS, Nodes, losses_by_step, read_metrics, wait_for

pytestmark = pytest.mark.slow
TIMEOUT_S = 240
COLLECTIVE_TIMEOUT_S = 10


def _committed(output_dir, step):
    return (output_dir / f"step_{step}" / "tunelab_manifest.json").is_file()


def _resumes(nodes) -> list[tuple[int, int]]:
    """``(restart, step)`` of every "restart K of 2: resumed from step_N" line, in order."""
    found = re.findall(r"restart (\d+) of 2: resumed from step_(\d+)", nodes.output())
    return [(int(restart), int(step)) for restart, step in found]


def test_killed_and_hung_workers_restart_and_resume(tmp_path, lora_2p):
    out = tmp_path / "out"
    nodes = Nodes(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", "schedule.batch_size=8", *COMMON,
        # A synchronous save after every step: each step is a point to resume from.
        "checkpoint.save_every_n_steps=1", "checkpoint.enable_async_checkpointing=false",
        "checkpoint.resume_from_checkpoint=auto", f"parallelism.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
        log_dir=tmp_path, launcher=("--max-restarts", "2"),
    )  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S  # one hard limit for the whole test

    def left() -> float:
        return deadline - time.monotonic()

    try:
        wait_for(lambda: _committed(out, 1), left(), "step_1", nodes)
        _signal_workers(nodes, 1, signal.SIGKILL)
        first = wait_for(lambda: _resumes(nodes), left(), "restart 1", nodes)[0][1]
        wait_for(lambda: _committed(out, first + 1), left(), f"step_{first + 1}", nodes)
        frozen = _signal_workers(nodes, 0, signal.SIGSTOP)
        # Its peer's collective times out and fails; torchrun would SIGKILL the frozen worker
        # 30 s later (fixed in torch 2.13): the test does it as soon as the timeout is reported.
        wait_for(lambda: "timed out" in nodes.output().lower(), left(), "the timeout", nodes)
        for pid in frozen:
            os.kill(pid, signal.SIGKILL)
        nodes.wait(left())
    finally:
        nodes.kill()
    output = nodes.output()
    # Two restarts, each resuming from a newer step. torchrun counts restarts per node and the
    # line shows the highest count, so the second may say 1 or 2 (docs/scaling.md).
    (restart_1, _), (restart_2, second) = _resumes(nodes)
    assert restart_1 == 1 and restart_2 in (1, 2) and second > first, output
    # The frozen worker's peer timed out in a collective and said so before the restart.
    assert re.search(r"tunelab: error \(restarting\): .*timed out", output, re.IGNORECASE), output

    losses, reference = losses_by_step(out), losses_by_step(lora_2p)
    for step, loss in losses.items():
        assert abs(loss - reference[step]) <= 1e-6, (step, loss, reference[step])
    # Each step logged once: the records a restarted run repeats were dropped on resume.
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, STEPS + 1))
    assert (out / "epoch_0" / "tunelab_manifest.json").is_file()


def _signal_workers(nodes: Nodes, node: int, signum: int) -> list[int]:
    workers = nodes.workers(node)
    assert workers, f"node {node} has no workers"
    for pid in workers:
        os.kill(pid, signum)
    return workers
