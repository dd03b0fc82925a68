"""A stop signal becomes a committed checkpoint at a step every rank agrees on.

Schedulers stop jobs with SIGTERM (SLURM at the time limit, on ``scancel`` and on
preemption; Kubernetes on eviction), people with Ctrl-C (SIGINT). What a worker does with
the first one depends on where it is:

- **Before the training loop** (imports, model loading, resume) and in scripts that never
  start one: nothing new to save. It prints one line on rank 0 and exits with
  128 + signal at once.
- **In the training loop** (after the recipe built its :class:`Preemption`): the signal only
  sets a flag. At the end of each optimizer step every rank joins one tiny all-reduce (MAX) of
  its flag, so all ranks see the same answer at the same step even when the signal reached
  only some of them; they finish that step, write a synchronous checkpoint there (or wait for
  the one the schedule already started), and raise :class:`TrainingStopped`, which
  ``recipe_main`` turns into one line on rank 0 and exit code 128 + signal (143 for SIGTERM,
  130 for SIGINT).
- **After the loop** (clean-up): the run ends normally, then exits with 128 + signal.

A second signal exits at once, without a checkpoint. A repeat within
:data:`REPEAT_WINDOW_S` of the first counts as the same signal: when a scheduler signals every
process, a worker gets it twice within milliseconds, once directly and once forwarded by
torchrun (whose handlers forward the signal to every worker, wait
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds, then SIGKILL them).

Signals that reach a worker while it is still importing torch are not lost: ``tunelab run``
starts workers with SIGTERM and SIGINT blocked (:func:`stop_signals_blocked`), so they stay
pending until :func:`install_stop_handlers` unblocks them.

A worker's own helper processes (a streaming dataset's ``DataLoader`` workers) never act on a
stop signal: the worker owns it and ends them itself when it exits. They get it all the same:
torchrun signals each worker's whole process group, SLURM every process of the job. torch's
handler in a ``DataLoader`` worker dies on a SIGTERM from anyone but its parent, and the
worker's next batch then fails (``DataLoader worker ... is killed by signal: Terminated``)
before the step's checkpoint. :func:`leave_stop_signals_to_parent` (their ``worker_init_fn``)
keeps them running until their parent stops them.
"""

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from tunelab.lifecycle.run_folder import RunFolder

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run with a checkpoint."""
REPEAT_WINDOW_S = 2.0
"""A stop signal this soon after the first is the same one, delivered twice."""
REPORTED_BY_LAUNCHER_ENV = "TUNELAB_LAUNCHER_REPORTS"
"""Set by ``tunelab run`` for its workers: it prints their recorded error lines, the first stop
signal's notice and the second's line itself."""
STOP_LINE_FILE_ENV = "TUNELAB_STOP_LINE_FILE"
"""Set by ``tunelab run``: where rank 0 writes a stop line the launcher prints for it.

"stopped by SIGTERM before a checkpoint was committed (...)", when a collective broke after a
stop signal: that happens in a real stop (a peer exited on the signal first), and also when a
peer died on its own (the OOM killer) and torchrun then stopped the others: the launcher knows
which, and prints the line only for a real stop (the failed rank's own error otherwise). And
"stopped by a second signal (...)" when the second signal reached the workers but not the
launcher (which otherwise prints that line itself).
"""


def stopping_notice(signum: int) -> str:
    """The line that says what the first stop signal does, printed at once.

    ``tunelab run`` prints it (rank 0 under plain torchrun), even while a rank hangs in a
    collective or in a reward and no step boundary comes soon.
    """
    name = signal_name(signum)
    again = (
        "press Ctrl-C again" if signum == signal.SIGINT else f"send {name} again or press Ctrl-C"
    )
    return (
        f"tunelab: {name}: stopping at the next step boundary (with a checkpoint); "
        f"{again} to stop at once"
    )


def second_signal_line(signum: int) -> str:
    """The line of a run ended by a second stop signal: at once, without a checkpoint."""
    return f"stopped by a second signal ({signal_name(signum)}): no checkpoint"


def launched_by_tunelab_run() -> bool:
    """Whether ``tunelab run`` started this process (and prints its lines for it)."""
    return os.environ.get(REPORTED_BY_LAUNCHER_ENV) == "1"


class TrainingStopped(BaseException):
    """Ends a recipe after a stop signal; ``recipe_main`` prints the message on rank 0.

    A ``BaseException``, like ``KeyboardInterrupt``, so a recipe's ``except Exception`` does
    not swallow it.

    Args:
        signum: The signal that stopped the run.
        message: The one line to print.
    """

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.message = message

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process a signal ended."""
        return 128 + self.signum


class _Closeable(Protocol):
    def close(self) -> None: ...


class _Checkpoints(Protocol):
    """What :class:`Preemption` needs of a ``CheckpointClient``."""

    output_dir: Any

    def save(
        self, step: int, epoch: int, progress: dict[str, Any], *, blocking: bool = False
    ) -> Any: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class _SignalState:
    signum: int | None = None
    """The first stop signal this process received."""
    first_at: float = 0.0
    """When it came (monotonic seconds)."""
    deferred: bool = False
    """Whether a training loop is watching (stop at a step) rather than exit at once."""


_state = _SignalState()


def install_stop_handlers() -> None:
    """Handle SIGTERM and SIGINT as described in this module; ``recipe_main`` calls it first.

    Until a :class:`Preemption` exists, a stop signal exits at once (one line on rank 0,
    128 + signal). Must run in the main thread.
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, _handle_stop_signal)
    # `tunelab run` starts workers with these signals blocked: one that came during start-up
    # is pending, not lost (SIGTERM) or a KeyboardInterrupt traceback (SIGINT). Deliver it now.
    if hasattr(signal, "pthread_sigmask"):  # Not on Windows.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def defer_stop_signals() -> None:
    """From now on a first stop signal only sets the flag :func:`signal_received` reads.

    For a process whose peers end it once they committed their checkpoint (a rollout rank of
    asynchronous GRPO, which its trainers tell to stop): it must keep serving them until then,
    and then exits with 128 + signal (``recipe_main``). A second signal still exits at once.
    """
    _state.deferred = True


def signal_received() -> int | None:
    """The first stop signal this process received, or None."""
    return _state.signum


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, and so on."""
    return signal.Signals(signum).name


def _handle_stop_signal(signum: int, frame: Any) -> None:
    now = time.monotonic()
    if _state.signum is None:
        _state.signum, _state.first_at = signum, now
        if not _state.deferred:
            _exit_now(signum, f"stopped by {signal_name(signum)} before training started")
        if not launched_by_tunelab_run() and _is_rank_0():
            # Under plain torchrun no launcher says it; `tunelab run` does, even while a rank hangs.
            _write_raw(2, f"\n{stopping_notice(signum)}\n")
        return
    if now - _state.first_at < REPEAT_WINDOW_S:
        return  # The first signal again: sent to every process and forwarded by torchrun.
    # Under `tunelab run` a second signal to the launcher kills the workers and it prints the
    # line; one that reached only the workers leaves its line to the launcher too.
    _exit_now(signum, second_signal_line(signum), via_launcher=launched_by_tunelab_run())


def _is_rank_0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _write_raw(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode())  # No Python stream lock: the interrupted code may hold it.
    except OSError:
        pass


def _exit_now(signum: int, line: str, *, via_launcher: bool = False) -> NoReturn:
    # Exits from inside the signal handler: unwinding would run `finally` blocks that may wait
    # in collectives for peers that are exiting too.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream busy in the interrupted code; exit anyway
            pass
    stop_line_file = os.environ.get(STOP_LINE_FILE_ENV)
    if _is_rank_0():
        if via_launcher and stop_line_file:
            try:
                with open(stop_line_file, "w") as file:
                    file.write(line)
            except OSError:
                _write_raw(1, line + "\n")
        else:
            _write_raw(1, line + "\n")
    os._exit(128 + signum)


class Preemption:
    """Stops the training loop at a step every rank agrees on, with a committed checkpoint.

    Build it right before the training loop; from then on a stop signal waits for the end of
    the step. At the end of every optimizer step, on every rank::

        if preemption.stop_agreed():  # a collective
            preemption.stop(step, epoch, progress, saved=schedule_saved_this_step)

    Args:
        checkpoints: The run's ``CheckpointClient``.
        close: Things to close before the process exits (progress bar, metric loggers).
    """

    def __init__(self, checkpoints: _Checkpoints, *, close: Iterable[_Closeable] = ()) -> None:
        if threading.current_thread() is threading.main_thread():
            install_stop_handlers()  # Idempotent; a recipe run without recipe_main needs it.
        self._checkpoints = checkpoints
        self._close = list(close)
        self._agreed = 0
        _state.deferred = True

    def also_close(self, closeable: _Closeable) -> None:
        """Close ``closeable`` too, after the others, when a stop signal ends the run.

        Args:
            closeable: What a stop must also close (asynchronous GRPO's link to its rollout
                ranks, which then stop too).
        """
        self._close.append(closeable)

    def stop_agreed(self) -> bool:
        """Whether any rank received a stop signal; the same answer on every rank.

        A collective: every rank calls it once per optimizer step, at the same point. One
        all-reduce (MAX) of the signal number (0 for none) in a CPU tensor, so it goes through
        gloo even on a ``cuda:nccl,cpu:gloo`` group; without a process group, this rank's flag.

        Returns:
            True when the run should stop after this step.
        """
        self._agreed = _max_over_ranks(_state.signum or 0)
        return self._agreed != 0

    def stop(self, step: int, epoch: int, progress: dict[str, Any], *, saved: bool) -> NoReturn:
        """Commit a checkpoint of ``step`` and end the run; call when :meth:`stop_agreed`.

        Args:
            step: The global step just completed.
            epoch: Its epoch.
            progress: The recipe's progress record for a checkpoint of this step.
            saved: Whether the recipe's schedule already saved this step (then only wait for
                that save to be committed). The same on every rank.

        Raises:
            TrainingStopped: Always, once the checkpoint is committed and the checkpoint
                client, progress bar and loggers are closed.
        """
        if saved:
            self._checkpoints.wait()
        else:
            self._checkpoints.save(step, epoch, progress, blocking=True)
        # Waits for anything still in flight and tears the checkpoint group down in step.
        self._checkpoints.close()
        for closeable in self._close:
            closeable.close()
        checkpoint = RunFolder(self._checkpoints.output_dir).step_dir(step).name
        raise TrainingStopped(
            self._agreed,
            f"stopped by {signal_name(self._agreed)} at step {step}; checkpoint {checkpoint} "
            "committed; resume with checkpoint.resume_from_checkpoint=true",
        )


def _max_over_ranks(value: int) -> int:
    import torch  # Here, not at the top: `tunelab run` imports this module without torch.
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    flag = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


@contextmanager
def stop_signals_blocked(*, keep_receiving: bool = False) -> Iterator[None]:
    """Block SIGTERM and SIGINT in this thread; processes it starts inherit them blocked.

    A child started inside the block keeps these signals pending until it unblocks them
    (:func:`install_stop_handlers`), so a stop that comes while it is still importing torch
    is neither lost nor a ``KeyboardInterrupt`` traceback.

    Args:
        keep_receiving: Leave a thread with the signals unblocked, started before blocking,
            so this process still receives them while the block lasts: the kernel hands them
            to that thread and Python runs the handlers in the main thread as usual (within
            the main thread's next return to Python; torchrun's agent loop polls every 0.1 s).
            Needed when the block covers a whole torchrun launch, which spawns the workers
            from inside.
    """
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks.
        yield
        return
    if keep_receiving:
        _start_signal_receiver()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_PARENT_POLL_S = 0.5
"""How often a helper process checks that its parent is alive."""


def leave_stop_signals_to_parent(worker_id: int = 0) -> None:
    """Make this helper process leave SIGTERM and SIGINT to its parent; a ``worker_init_fn``.

    From now on a stop signal from anyone else (torchrun's signal to the worker's process
    group, SLURM's to every process, Ctrl-C) is taken and dropped by a thread of this process;
    a SIGTERM from the parent still ends it at once, as torch's own worker handler does, so
    ``DataLoader``'s shutdown (which terminates a worker that does not join in time) works.
    The process also exits when its parent is gone (a worker that ended at once on a second
    signal leaves its helpers no one to stop them).

    Start the process with the signals blocked (fork it inside :func:`stop_signals_blocked`):
    one that comes between the fork and this call then waits here instead of killing it.

    Args:
        worker_id: The ``DataLoader`` worker's index (unused; the ``worker_init_fn`` signature).
    """
    if not hasattr(signal, "sigtimedwait"):  # Not on macOS or Windows: ignore them outright.
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        return
    # Blocked in every thread (threads started later inherit the mask), so a stop signal stays
    # pending until the thread below takes it: torch's C handler never sees it.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # The parent as multiprocessing recorded it before the fork (DataLoader workers are its
    # processes): os.getppid() would already name init if the parent died since.
    recorded = multiprocessing.parent_process()
    parent = recorded.pid if recorded is not None and recorded.pid else os.getppid()
    threading.Thread(
        target=_take_stop_signals, args=(parent,), daemon=True, name="tunelab-signals"
    ).start()


def _take_stop_signals(parent: int) -> NoReturn:
    while True:
        info = signal.sigtimedwait(STOP_SIGNALS, _PARENT_POLL_S)
        if info is not None and info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)  # The parent stops its helper: exit at once, as torch's handler does.
        if os.getppid() != parent:
            os._exit(0)


_receiver: threading.Thread | None = None


def _start_signal_receiver() -> None:
    global _receiver
    if _receiver is None:
        # Threads inherit their creator's mask: this one must start before the block.
        _receiver = threading.Thread(
            target=threading.Event().wait, daemon=True, name="tunelab-signals"
        )
        _receiver.start()
