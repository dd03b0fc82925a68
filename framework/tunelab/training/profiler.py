"""Profile a few training steps: one Chrome trace per rank, for Perfetto or chrome://tracing.

Usage, around the training loop::

    profiler = StepProfiler(run.profile_dir, enabled=True, skip_first=5, record_steps=3)
    for batch in loader:
        ...  # forward, backward, optimizer step
        profiler.step()
    profiler.close()

Steps are counted by calls to :meth:`StepProfiler.step`. The first ``skip_first`` are not
recorded (start-up, allocator and cache warm-up distort them); the last of them runs the
profiler without recording (its own start-up cost); the next ``record_steps`` are recorded and
written to ``{output_dir}/profile/rank_{rank}.json``. Then the profiler stops, so the rest of the
run pays nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
import torch.profiler
from torch.profiler import ProfilerActivity, schedule

from tunelab.config.sections import ProfileArgs
from tunelab.errors import ConfigError

logger = logging.getLogger(__name__)

"""The folder under the output folder that holds the traces."""


class StepProfiler:
    """Record ``record_steps`` training steps after ``skip_first`` with ``torch.profiler``.

    Args:
        directory: Where the traces go (``RunFolder.profile_dir``: ``{output_dir}/profile/``).
        profile: The ``profile`` settings: ``enabled`` (when False every call is a no-op),
            ``skip_first`` (steps to run before recording; at least 1 is advised: the
            profiler warms up during the last skipped step), ``record_steps``.

    Raises:
        ConfigError: ``skip_first`` is negative or ``record_steps`` is not positive.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        profile: ProfileArgs,
    ) -> None:
        enabled, skip_first, record_steps = (
            profile.enabled,
            profile.skip_first,
            profile.record_steps,
        )
        if skip_first < 0:
            raise ConfigError(f"profiler skip_first must be 0 or more, got {skip_first}")
        if record_steps < 1:
            raise ConfigError(f"profiler record_steps must be 1 or more, got {record_steps}")
        self.directory = Path(directory)
        self.skip_first = skip_first
        self.record_steps = record_steps
        self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.trace_path = self.directory / f"rank_{self._rank}.json"
        """Where this rank's trace goes."""
        self._num_steps = 0
        self._written = False
        self._profiler: torch.profiler.profile | None = None
        if enabled:
            # The last skipped step is the profiler's warm-up: it runs but is not recorded.
            warmup = min(skip_first, 1)
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities,
                schedule=schedule(
                    skip_first=skip_first - warmup,
                    wait=0,
                    warmup=warmup,
                    active=record_steps,
                    repeat=1,
                ),
                on_trace_ready=self._write_trace,
            )
            self._profiler.start()

    @property
    def enabled(self) -> bool:
        """Whether the profiler is still running (False once the trace is written)."""
        return self._profiler is not None

    def step(self) -> None:
        """Mark the end of one training step; call it after every optimizer step."""
        if self._profiler is None:
            return
        self._num_steps += 1
        self._profiler.step()
        if self._written:
            self._profiler.stop()
            self._profiler = None

    def close(self) -> None:
        """Stop profiling; a recording cut short by the end of training is still written."""
        if self._profiler is None:
            return
        self._profiler.stop()  # writes the trace if it was recording
        self._profiler = None
        if not self._written and self._rank == 0:
            logger.warning(
                "profiler recorded nothing: training ended after %d step(s), before step %d "
                "(skip_first=%d)",
                self._num_steps,
                self.skip_first + 1,
                self.skip_first,
            )

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _write_trace(self, prof: Any) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.trace_path))
        self._written = True
        if self._rank == 0:
            first = self.skip_first + 1
            last = min(self.skip_first + self.record_steps, self._num_steps)
            logger.info(
                "profiled steps %d-%d: Chrome traces in %s (rank_N.json, one per rank; open "
                "them in https://ui.perfetto.dev or chrome://tracing)",
                first,
                last,
                self.directory,
            )
