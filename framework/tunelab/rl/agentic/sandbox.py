"""A sandboxed Python interpreter tool: model-written code in a limited, throw-away subprocess.

Each call runs the code in a fresh interpreter (``python -I -S``: no site packages, no
``PYTHON*`` variables) in a fresh temporary working folder that is deleted afterwards, with:

- an environment of its own (``PATH``, ``HOME`` = the folder, ``LANG``): none of the run's
  variables (tokens, keys, ``MASTER_ADDR``) are visible;
- ``RLIMIT_CPU`` (CPU seconds; the kernel kills it), ``RLIMIT_AS`` (address space: a memory bomb
  is a ``MemoryError``), ``RLIMIT_FSIZE`` (stdout and stderr go to a file of at most
  ``max_output_bytes``: 1 GB of output stops there), ``RLIMIT_NPROC`` and ``RLIMIT_NOFILE``;
- a wall-time limit: after ``wall_seconds`` its whole process group is killed;
- an audit hook (PEP 578) that refuses ``fork``, ``exec``, ``system``, spawning, and importing
  ``socket``, ``ctypes``, ``_posixsubprocess`` and ``multiprocessing``: a fork bomb or a
  network connection ends as an error before it starts.

What it does not guarantee: it is no container. The code runs as the run's user and can read
every file that user can (the model's weights, ``/etc``); as root the kernel ignores
``RLIMIT_NPROC`` and the audit hook is the only fork guard; an audit hook is not a security
boundary against a determined attacker (a C extension already on the path could bypass it).
Run untrusted policies in a container or VM (gVisor, Firecracker) for isolation.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tunelab.rl.agentic.tools import ToolFailure

__all__ = ["PythonSandbox", "SandboxLimits"]

# Runs inside the child: limits first, then the hook, then the model's code.
_BOOTSTRAP = r"""
import resource, sys
cpu, memory, output, files = (int(value) for value in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
_REFUSED_EVENTS = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
                   "os.system", "subprocess.Popen", "os.setsid", "socket.__new__", "pty.spawn",
                   "ctypes.dlopen")
_REFUSED_MODULES = ("socket", "_socket", "ctypes", "_ctypes", "_posixsubprocess",
                    "multiprocessing", "_multiprocessing", "ssl", "_ssl")
def _guard(event, args):
    if event in _REFUSED_EVENTS or (event == "import" and args[0] in _REFUSED_MODULES):
        raise PermissionError(f"the sandbox does not allow {event} {args[0] if args else ''}")
sys.addaudithook(_guard)
del resource, cpu, memory, output, files
_source = open("main.py").read()
exec(compile(_source, "main.py", "exec"), {"__name__": "__main__"})
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Attributes:
        cpu_seconds: CPU time (``RLIMIT_CPU``).
        wall_seconds: Wall time before the process group is killed.
        memory_bytes: Address space (``RLIMIT_AS``).
        max_output_bytes: stdout and stderr together (``RLIMIT_FSIZE`` on their file).
        max_open_files: ``RLIMIT_NOFILE``.
    """

    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_bytes: int = 512 * 2**20
    max_output_bytes: int = 64 * 2**10
    max_open_files: int = 64


class PythonSandbox:
    """Run Python source under :class:`SandboxLimits` and return its stdout and stderr.

    As a tool (``tools: [{_component_: tunelab.rl.agentic.PythonSandbox}]``) it offers one
    method, ``python(code)``, shared by every episode (each call is its own process).

    Args:
        cpu_seconds: CPU time (``RLIMIT_CPU``).
        wall_seconds: Wall time before the process group is killed.
        memory_mb: Address space in MiB (``RLIMIT_AS``).
        max_output_bytes: stdout and stderr together.
        interpreter: The Python interpreter (the running one by default).
    """

    def __init__(
        self,
        cpu_seconds: int = 5,
        wall_seconds: float = 10.0,
        memory_mb: int = 512,
        max_output_bytes: int = 64 * 2**10,
        interpreter: str | None = None,
    ) -> None:
        self.limits = SandboxLimits(cpu_seconds, wall_seconds, memory_mb * 2**20, max_output_bytes)
        self.interpreter = interpreter or sys.executable

    def python(self, code: str) -> str:
        """Run Python code in a fresh sandbox and return what it printed (stdout and stderr).

        Args:
            code: The Python source to run; print what you want to see.
        """
        return self._run(code)

    def _run(self, code: str) -> str:
        """Run ``code``; its output (stdout and stderr, interleaved) is the result.

        Args:
            code: Python source.

        Returns:
            The output.

        Raises:
            ToolFailure: ``exception`` (a non-zero exit: the output, then ``[exit status N]``;
                a ``MemoryError`` past the memory limit, a refused import), ``timeout`` (CPU
                or wall time) or ``sandbox`` (killed by the kernel for another limit, such as
                the output size): the tool's error message.
        """
        limits = self.limits
        folder = Path(tempfile.mkdtemp(prefix="tunelab_sandbox_"))
        try:
            (folder / "main.py").write_text(code)
            output = folder / "output.txt"
            argv = [
                self.interpreter,
                "-I",
                "-S",
                "-c",
                _BOOTSTRAP,
                str(limits.cpu_seconds),
                str(limits.memory_bytes),
                str(limits.max_output_bytes),
                str(limits.max_open_files),
            ]
            env = {"PATH": "/usr/bin:/bin", "HOME": str(folder), "LANG": "C.UTF-8"}
            start = time.perf_counter()
            with output.open("wb") as sink:
                process = subprocess.Popen(
                    argv,
                    cwd=folder,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # one group: the wall-time kill takes it all
                )
                try:
                    status = process.wait(timeout=limits.wall_seconds)
                except subprocess.TimeoutExpired:
                    _kill_group(process)
                    raise ToolFailure(
                        "timeout", f"the code ran longer than {limits.wall_seconds:g} s (wall time)"
                    ) from None
            raw = output.read_bytes()[: limits.max_output_bytes]
            # CPython ignores SIGXFSZ: past RLIMIT_FSIZE its writes fail with EFBIG instead.
            if len(raw) >= limits.max_output_bytes:
                status = -signal.SIGXFSZ
            text = raw.decode("utf-8", "replace")
            return _result(text, status, limits, time.perf_counter() - start)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _result(text: str, status: int, limits: SandboxLimits, seconds: float) -> str:
    if status == -signal.SIGXCPU or status == -signal.SIGKILL and seconds >= limits.cpu_seconds:
        raise ToolFailure("timeout", f"the code used more than {limits.cpu_seconds} s of CPU time")
    if status == -signal.SIGXFSZ:
        raise ToolFailure(
            "sandbox",
            f"the code printed more than {limits.max_output_bytes} bytes: {text[:200]}...",
        )
    if status < 0:
        raise ToolFailure("sandbox", f"the sandbox was killed by signal {-status}: {text[-200:]}")
    if status != 0:  # an exception (MemoryError past the memory limit, PermissionError, ...)
        raise ToolFailure("exception", f"{text}[exit status {status}]")
    return text
