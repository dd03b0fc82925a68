"""Process lifecycle: who owns an output_dir, how long workers live, how a run stops.

Three promises (docs/recipes.md, "Stopping, preemption and orphans"):

- One run owns an output_dir: :class:`RunFolder` names every path in it, and its rank 0 holds
  a lock on it for its whole life (:meth:`RunFolder.start`; ``tunelab run`` checks it before
  starting anything).
- Workers never outlive their launcher: they die with it, even when it is SIGKILLed
  (:func:`exit_with_launcher`, called by ``recipe_main``).
- A stop signal (SIGTERM, SIGINT) becomes a committed checkpoint at a step every rank agrees
  on (:class:`Preemption`), then exit code 128 + signal.

And one fact a restarted run reports: which torchrun restart (``--max-restarts``) it is
(:func:`restart_of_job`).

Nothing here imports torch at module level: ``tunelab run`` uses the launcher half of each
promise without it (its one-process path never loads torch). The collectives import it when
they run.
"""

from tunelab.lifecycle.entry import parse_recipe_cli, recipe_main
from tunelab.lifecycle.output_lock import LOCK_FILE_NAME, check_output_dir_free, lock_output_dir
from tunelab.lifecycle.parent_death import LAUNCHER_PID_ENV, exit_with_launcher
from tunelab.lifecycle.preemption import (
    STOP_SIGNALS,
    Preemption,
    TrainingStopped,
    defer_stop_signals,
    install_stop_handlers,
    signal_received,
    stop_signals_blocked,
)
from tunelab.lifecycle.restarts import restart_of_job
from tunelab.lifecycle.run_folder import (
    STEP_LOGS,
    CommittedCheckpoint,
    RunFolder,
    UnreadableCheckpoint,
)

__all__ = [
    "LAUNCHER_PID_ENV",
    "LOCK_FILE_NAME",
    "STEP_LOGS",
    "STOP_SIGNALS",
    "CommittedCheckpoint",
    "Preemption",
    "RunFolder",
    "TrainingStopped",
    "UnreadableCheckpoint",
    "check_output_dir_free",
    "defer_stop_signals",
    "exit_with_launcher",
    "install_stop_handlers",
    "lock_output_dir",
    "parse_recipe_cli",
    "recipe_main",
    "restart_of_job",
    "signal_received",
    "stop_signals_blocked",
]
