"""bench_grpo's per-process bookkeeping: step phases, the work done, peak RSS, the result file."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from _common import gather_floats

TIMES = ("step_s", "rollout_s", "update_s", "generate_s", "step_cpu_s")
"""Per-step seconds, the slowest rank's: whole step, rollout phase, update phase, generate calls,
and the step's CPU seconds of this process (``time.process_time``: robust to other load)."""
COUNTS = ("generated_tokens",)
"""Per-step counts, summed over ranks."""


class StepClock:
    """Phase times and counts of each step of this process."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._clock = self._begin = self._begin_cpu = 0.0

    def start(self) -> None:
        """A step begins."""
        self.steps.append(dict.fromkeys(TIMES + COUNTS, 0.0))
        self._clock = self._begin = time.perf_counter()
        self._begin_cpu = time.process_time()

    def lap(self, phase: str) -> None:
        """The time since the last lap (or the start) goes to ``phase``."""
        now = time.perf_counter()
        self.add(phase, now - self._clock)
        self._clock = now

    def add(self, key: str, value: float) -> None:
        """Add ``value`` to this step's ``key`` (before the first step: nothing)."""
        if self.steps:
            self.steps[-1][key] += value

    def stop(self) -> None:
        """The step ends."""
        self.add("step_s", time.perf_counter() - self._begin)
        self.add("step_cpu_s", time.process_time() - self._begin_cpu)


def finish(
    result: str, clock: StepClock, work: list[list[tuple[int, int]]], load_peak: int, peak: int
) -> None:
    """Combine every rank's figures, write them on rank 0, and exit the process.

    Args:
        result: The JSON file to write.
        clock: This rank's steps.
        work: This rank's ``(prompt tokens, completion tokens)`` per row, per step.
        load_peak: Peak RSS before the first step (the build).
        peak: Peak RSS over the steps (reset after the build).
    """
    times = torch.tensor([[s[k] for k in TIMES] for s in clock.steps], dtype=torch.float64)
    counts = torch.tensor([[s[k] for k in COUNTS] for s in clock.steps], dtype=torch.float64)
    gathered = [work]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        dist.all_reduce(counts)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, work)
    load_peaks, peaks = gather_floats(float(load_peak)), gather_floats(float(peak))
    if not dist.is_initialized() or dist.get_rank() == 0:
        steps = [
            dict(zip(TIMES + COUNTS, t.tolist() + c.tolist(), strict=True))
            for t, c in zip(times, counts, strict=True)
        ]
        all_work = [sorted(row for part in gathered for row in part[i]) for i in range(len(work))]
        record = {"steps": steps, "work": all_work, "load_peak_rss": load_peaks, "peak_rss": peaks}
        Path(result).write_text(json.dumps(record))
    if dist.is_initialized():
        dist.barrier()
    # Exit without tearing gloo down (torch 2.13's ProcessGroupGloo destructor can deadlock or
    # abort at exit: bench_training.write_result); only stdio is left to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
