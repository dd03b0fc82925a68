"""The launch server's rules (``tunelab.cli.launch_server``): what it refuses to run."""

import os
import resource
import subprocess
import sys

import pytest

from tunelab.cli import launch_server
from tunelab.cli.launch_server import refusal
from tunelab.lifecycle import zygote
from tunelab.lifecycle.worker_client import resource_limits


def _request(**changes):
    request = {
        "executable": sys.executable,
        "version": sys.version,
        "flags": list(sys.flags),
        "warnoptions": sys.warnoptions,
        "xoptions": {str(k): str(v) for k, v in sys._xoptions.items()},
        "environ": {"PATH": "/bin", "OMP_NUM_THREADS": "1", "HOME": "/root"},
        "argv": ["/venv/bin/tunelab", "run"],
    }
    request.update(changes)
    return request


BASELINE = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "HOME": "/root"}


@pytest.fixture
def single_threaded(monkeypatch):
    """This test process as the server would be: one thread (pytest's torch runs more)."""
    monkeypatch.setattr(zygote.threading, "active_count", lambda: 1)
    real = os.listdir
    monkeypatch.setattr(
        zygote.os, "listdir", lambda path: ["1"] if path == "/proc/self/task" else real(path)
    )


def test_a_server_with_threads_refuses():
    assert refusal(_request(), dict(BASELINE)).startswith("the launch server runs ")


def test_the_same_interpreter_and_environment_is_served(single_threaded):
    assert refusal(_request(), dict(BASELINE)) is None


def test_tunelab_pytest_and_shell_variables_may_differ(single_threaded):
    shell = {"_": "/venv/bin/tunelab", "SHLVL": "3", "PWD": "/work", "OLDPWD": "/"}
    ours = {"TUNELAB_WORKER_ZYGOTE": "0", "TUNELAB_LAUNCH_SERVER": "/tmp/s"}
    environ = {**BASELINE, **shell, **ours, "PYTEST_CURRENT_TEST": "tests/x.py::t (call)"}
    assert refusal(_request(environ=environ), dict(BASELINE, TUNELAB_DEBUG="1")) is None


def test_any_other_environment_difference_is_refused(single_threaded):
    for key, value in (("OMP_NUM_THREADS", "2"), ("PYTHONHASHSEED", "0"), ("LD_PRELOAD", "x")):
        environ = dict(BASELINE, **{key: value})
        assert refusal(_request(environ=environ), dict(BASELINE)) == (
            f"the command's environment differs from the launch server's in {key}"
        )
    missing = {k: v for k, v in BASELINE.items() if k != "HOME"}
    assert "in HOME" in refusal(_request(environ=missing), dict(BASELINE))


def test_another_interpreter_or_flags_are_refused(single_threaded):
    reason = "the command's interpreter or its flags differ from the launch server's"
    assert refusal(_request(executable="/usr/bin/python3"), dict(BASELINE)) == reason
    flags = list(sys.flags)
    flags[0] = 1 - flags[0]
    assert refusal(_request(flags=flags), dict(BASELINE)) == reason
    assert refusal(_request(warnoptions=["error"]), dict(BASELINE)) == reason


def test_resource_limits_at_or_below_the_servers_are_served_and_above_refused(single_threaded):
    ours = resource_limits()
    assert refusal(_request(rlimits=ours), dict(BASELINE)) is None
    lower = dict(ours, RLIMIT_FSIZE=[4096, 4096])  # `ulimit -f 4`: the child takes it on
    assert refusal(_request(rlimits=lower), dict(BASELINE)) is None
    finite = [name for name, (_, hard) in ours.items() if hard != resource.RLIM_INFINITY]
    assert finite  # RLIMIT_NOFILE's hard limit at least
    for name in finite:
        soft, hard = ours[name]
        for above in ([soft, hard + 1], [soft, resource.RLIM_INFINITY]):
            assert refusal(_request(rlimits=dict(ours, **{name: above})), dict(BASELINE)) == (
                f"the command's resource limit {name} is above the launch server's"
            )


def test_only_torchrun_launches_get_a_zygote_forked_early(monkeypatch):
    monkeypatch.delenv("TUNELAB_WORKER_ZYGOTE", raising=False)
    assert launch_server._wants_zygote(["run", "--nproc_per_node", "2", "r", "--config", "c"])
    assert launch_server._wants_zygote(["--debug", "eval", "--nproc_per_node", "2", "x"])
    assert not launch_server._wants_zygote(["run", "recipe", "--config", "c"])
    assert not launch_server._wants_zygote(["ls"])
    monkeypatch.setenv("TUNELAB_WORKER_ZYGOTE", "0")
    assert not launch_server._wants_zygote(["run", "--nproc_per_node", "2", "r"])


def test_importing_the_cli_elsewhere_never_hands_over(tmp_path):
    # Only the `tunelab` script hands itself over: a program that imports tunelab.cli runs on.
    env = dict(os.environ, TUNELAB_LAUNCH_SERVER=str(tmp_path / "no_server"))
    result = subprocess.run(
        [sys.executable, "-c", "import tunelab.cli; print('still here')"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout == "still here\n", result.stderr


def test_a_command_with_no_server_runs_cold_and_says_why_with_debug(tmp_path):
    tunelab = os.path.join(os.path.dirname(sys.executable), "tunelab")
    env = dict(os.environ, TUNELAB_LAUNCH_SERVER=str(tmp_path / "no_server"))
    quiet = subprocess.run([tunelab, "ls"], capture_output=True, text=True, env=env, timeout=120)
    loud = subprocess.run(
        [tunelab, "--debug", "ls"], capture_output=True, text=True, env=env, timeout=120
    )
    assert quiet.returncode == loud.returncode == 0
    assert quiet.stderr == "" and quiet.stdout == loud.stdout
    assert loud.stderr == (
        "tunelab: debug: command runs without the launch server: FileNotFoundError: "
        "[Errno 2] No such file or directory\n"
    )


def _stdio_of(*python_args: str, code: str, unbuffered_env: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered_env:
        env["PYTHONUNBUFFERED"] = "1"
    show = (
        "import os, sys\n"
        "streams = (sys.stdin, sys.stdout, sys.stderr)\n"
        "os.write(1, repr([(type(s.buffer).__name__, s.write_through, s.line_buffering,"
        " s.encoding, s.errors) for s in streams]).encode())\n"
    )
    result = subprocess.run(
        [sys.executable, *python_args, "-c", code + show],
        capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_fresh_stdio_makes_what_python_makes_at_start():
    # A forked worker of a zygote without -u gets `python -u`'s stdio, and back.
    fresh = "from tunelab.lifecycle.zygote import fresh_stdio; fresh_stdio({})\n"
    assert _stdio_of(code=fresh.format(True), unbuffered_env=False) == _stdio_of(
        "-u", code="", unbuffered_env=False
    )
    assert _stdio_of("-u", code=fresh.format(False), unbuffered_env=False) == _stdio_of(
        code="", unbuffered_env=False
    )
