"""Helpers for tests that launch real multi-process runs."""

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tunelab.lifecycle.worker_client import LAUNCH_SERVER_ENV

BIN_DIR = Path(sys.executable).parent
TUNELAB = str(BIN_DIR / "tunelab")
RECIPE_TIMEOUT_S = 600
TEST_SERVER_ENV = "TUNELAB_TEST_LAUNCH_SERVER"
"""``0``: the tests launch every ``tunelab`` command cold, without this worker's launch server."""
COLD = {LAUNCH_SERVER_ENV: ""}
"""``run_env(**COLD)``: a command that must start as a fresh process (its subject is that)."""
_server: dict = {}  # This pytest worker's launch server: "process", "path", "folder"


def launch_server() -> str | None:
    """This pytest worker's launch server socket (``tunelab.cli.launch_server``).

    Started on first use from a fresh interpreter with :func:`run_env`'s environment, so every
    ``tunelab`` command the tests launch with it forks from pre-imported state; stopped at the
    end of the session. None with ``TUNELAB_TEST_LAUNCH_SERVER=0``.
    """
    if os.environ.get(TEST_SERVER_ENV, "1") == "0":
        return None
    process = _server.get("process")
    if process is None or process.poll() is not None:
        if threading.current_thread() is not threading.main_thread():
            return None  # It would die with this thread (its parent-death signal): run cold.
        from tunelab.cli.launch_server import start_server

        stop_launch_server()
        folder = tempfile.mkdtemp(prefix="tunelab-test-launch-")
        path = os.path.join(folder, "socket")
        _server.update(process=start_server(path, _base_env()), path=path, folder=folder)
    return _server["path"]


def stop_launch_server() -> None:
    """Kill this worker's launch server (its running commands die with it)."""
    process = _server.pop("process", None)
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()
    folder = _server.pop("folder", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _launch_server_for_the_session():
    # Started before any test can change os.environ (a server started inside a test's
    # monkeypatch would refuse every later command: their environments would differ).
    launch_server()
    yield
    stop_launch_server()


def launcher_pid(pid: int) -> int:
    """The process that runs the ``tunelab`` command ``pid`` (itself, unless a server runs it).

    A served command's own process is a stand-in; the server's child runs the command and shows
    ``tunelab launch server child (stand-in pid PID)``.
    """
    process = _server.get("process")
    if process is None:
        return pid
    title = f"tunelab launch server child (stand-in pid {pid})".encode()
    for child in _own_children(process.pid):
        if _cmdline(child).split(b"\0")[0] == title:
            return child
    return pid


# The environment as this pytest worker started. Libraries a test imports or uses set
# variables in this process (sklearn: KMP_*, huggingface_hub: HF_XET_*, inductor: its cache
# folder and _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR, and any other); a launched run that uses
# them sets them itself. Passed on, they would make every later command's environment differ
# from the launch server's, and it would refuse them all (they would run cold). So the tests'
# commands get this snapshot; a test that wants a variable passes it (``run_env(NAME=value)``).
_AT_START = dict(os.environ)


def _base_env() -> dict[str, str]:
    env = dict(_AT_START)
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    env["OMP_NUM_THREADS"] = "1"
    return env


def limit_file_size(num_bytes: int):
    """A ``preexec_fn`` that caps the files the started process writes (``ulimit -f``: EFBIG)."""

    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, num_bytes))

    return apply


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_env(**extra: str) -> dict[str, str]:
    """The environment of the processes the tests start; ``tunelab`` runs on the launch server.

    ``extra`` wins: ``run_env(**COLD)`` starts a command cold.
    """
    env = _base_env()
    path = None if LAUNCH_SERVER_ENV in extra else launch_server()
    if path:
        env[LAUNCH_SERVER_ENV] = path
    env.update(extra)
    return env


def torchrun(script: Path, *args: str, nproc: int = 2, check: bool = True, **popen_kwargs):
    """Run ``script`` with torchrun on ``nproc`` local processes; return the completed process."""
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc), "--master-port", str(free_port()),
        str(script), *args,
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, env=_base_env(), timeout=RECIPE_TIMEOUT_S,
        **popen_kwargs,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def tunelab_run(
    recipe: str,
    config: str,
    *overrides: str,
    nproc: int = 2,
    check: bool = True,
    env: dict[str, str] | None = None,
):
    """Launch the real ``tunelab run`` (``nproc`` 1 runs without torchrun options).

    ``env``: variables added to :func:`run_env`'s environment.
    """
    launcher = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    command = [TUNELAB, "run", *launcher, recipe, "--config", config, *overrides]
    result = subprocess.run(
        command, capture_output=True, text=True, env=run_env(**(env or {})),
        timeout=RECIPE_TIMEOUT_S,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    return result


def interrupted_copy(
    source: Path, target: Path, *, after_step: int, keep_logs: bool = False
) -> Path:
    """``source`` as a run killed right after committing step ``after_step`` would leave it.

    ``keep_logs``: keep ``logs/`` whole, with the steps after ``after_step`` (a run killed
    later leaves some); the resume must trim them. Otherwise ``logs/`` is removed.
    """
    shutil.copytree(source, target)
    for path in target.iterdir():
        if path.name.startswith("step_") and int(path.name.split("_")[1]) > after_step:
            shutil.rmtree(path)
        elif path.name.startswith("epoch_") or (path.name == "logs" and not keep_logs):
            shutil.rmtree(path)
    return target


def our_model(base_dir: Path, adapter_dir: Path, **lora):
    """Our model as the recipe builds it on one process, with the exported adapter.

    ``lora``: the run settings the adapter file does not hold (``quantize_base="nf4"``).
    """
    import torch

    from tunelab.config.lora import LoRAArgs
    from tunelab.peft import read_adapter_config
    from tunelab.training import load_model

    args = LoRAArgs.from_peft_config(read_adapter_config(adapter_dir), **lora)
    model = load_model(
        str(base_dir), device=torch.device("cpu"), dtype=torch.float32, lora=args,
        adapter_dir=str(adapter_dir),
    )  # fmt: skip
    return model.eval()


def read_metrics(output_dir: Path) -> list[dict]:
    """Every record of ``{output_dir}/logs/metrics.jsonl``."""
    path = Path(output_dir) / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses_by_step(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(output_dir) if "loss" in r}


def assert_same_exports(
    output_dir: Path,
    reference_dir: Path,
    *,
    atol: float | None = None,
    merged_atol: float | None = None,
):
    """Every exported tensor (``epoch_*``: merged weights, adapter) equals the reference run's.

    ``atol`` None: bit for bit (``torch.equal``), for a resume on the world size it was saved
    with; a number: the largest absolute difference allowed (another world size sums in
    another order). ``merged_atol``, if given, holds the files outside ``adapter/`` (the merged
    weights) to a tighter bound than the adapter's factors.
    """
    import torch
    from safetensors.torch import load_file

    files = sorted(
        p.relative_to(reference_dir) for p in reference_dir.glob("epoch_*/**/*.safetensors")
    )
    assert files, f"{reference_dir} has no export"
    assert files == sorted(
        p.relative_to(output_dir) for p in output_dir.glob("epoch_*/**/*.safetensors")
    )
    for name in files:
        ours, expected = load_file(output_dir / name), load_file(reference_dir / name)
        assert ours.keys() == expected.keys(), name
        bound = atol if merged_atol is None or "adapter" in name.parts else merged_atol
        for key, tensor in ours.items():
            if bound is None:
                same = torch.equal(tensor, expected[key])
            else:
                same = torch.allclose(tensor, expected[key], rtol=0, atol=bound)
            difference = (tensor - expected[key]).abs().max().item()
            assert same, (str(name), key, difference, bound)


class Nodes:
    """``tunelab run`` started as several loopback "nodes" (one launcher each, c10d rendezvous).

    Each launcher runs in a session of its own with its output in a file; :meth:`wait` and
    :meth:`kill` end every process of every node, so a hang fails the test instead of CI.
    """

    def __init__(
        self, recipe, config, *overrides, log_dir, nnodes=2, nproc=1, launcher=(), env=None
    ):
        endpoint = f"127.0.0.1:{free_port()}"
        self.logs = [Path(log_dir) / f"node_{rank}.log" for rank in range(nnodes)]
        self.procs = []
        for rank, log in enumerate(self.logs):
            command = [
                TUNELAB, "run", "--nnodes", str(nnodes), "--node-rank", str(rank),
                "--nproc_per_node", str(nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, *launcher,
                recipe, "--config", config, *overrides,
            ]  # fmt: skip
            with open(log, "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        command, stdout=out, stderr=subprocess.STDOUT, env=run_env(**(env or {})),
                        start_new_session=True,
                    )
                )  # fmt: skip

    def workers(self, node: int) -> list[int]:
        """The pids of ``node``'s workers (Linux): the processes that run the recipe.

        The children of its launcher, or, where its zygote forked them
        (``tunelab.lifecycle.zygote``), the zygote's children instead of the zygote and of the
        stand-ins torchrun started (a frozen stand-in would leave its worker running).
        """
        from tunelab.lifecycle.zygote import ZYGOTE_CODE

        workers = []
        for child in _children(self.procs[node].pid):
            command = _cmdline(child)
            if ZYGOTE_CODE.encode() in command:
                workers += _children(child)
            elif not command.startswith(b"tunelab worker client"):
                workers.append(child)
        return workers

    def output(self, tail: int | None = None) -> str:
        """What the nodes printed (each node's last ``tail`` characters)."""
        texts = [log.read_text(errors="replace") for log in self.logs]
        return "\n".join(text[-tail:] if tail else text for text in texts)

    def wait(self, timeout: float, check: bool = True) -> list[int]:
        """Each launcher's exit code; kills everything and fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            codes = [
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1)) for proc in self.procs
            ]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"nodes still running after {timeout} s:\n{self.output(4000)}"
            ) from None
        if check and any(codes):
            raise AssertionError(f"nodes exited with {codes}:\n{self.output(4000)}")
        return codes

    def kill(self) -> None:
        """SIGKILL every node's workers, then its launcher's session."""
        for node, proc in enumerate(self.procs):
            for worker in self.workers(node):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _children(pid: int) -> list[int]:
    """The children of ``pid``; of its served command's process if it is a stand-in."""
    return _own_children(launcher_pid(pid))


def _own_children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(child) for child in children.read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def wait_for(condition, timeout: float, what: str, nodes: Nodes | None = None):
    """Poll ``condition`` every 10 ms until it is truthy; return its value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    if nodes is not None:
        nodes.kill()
    raise AssertionError(
        f"timed out waiting for {what}" + (f":\n{nodes.output(4000)}" if nodes else "")
    )


# The tiny 2-process runs several test modules compare with (test_sft_recipes' golden runs,
# the multi-node, HSDP and restart tests): global batch 16, 2 processes x 8 or 1 process x 16.
STEPS = 6
COMMON = [
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "schedule.run_val_every_n_steps=3",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=3",
    "checkpoint.keep_last_n_checkpoints=null",
]


def shared_run(tmp_path_factory, name: str, recipe: str, config: str, *overrides: str,
               nproc: int = 2) -> Path:  # fmt: skip
    """A run made once per test session and shared read-only (copy it to change it).

    Under pytest-xdist each worker is its own session: the first worker to ask makes the run
    in the folder all workers share, under a file lock; the others wait for it and reuse it.
    What the run printed is kept beside the folder, in ``launch_output(out)``.
    """
    out = _session_root(tmp_path_factory) / f"shared_{name}"
    done = out.with_name(out.name + ".done")
    with _session_lock(out):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a run that failed in another worker
            result = tunelab_run(recipe, config, f"output_dir={out}", *overrides, nproc=nproc)
            launch_output(out).write_text(result.stdout + result.stderr)
            done.touch()
    return out


def _session_root(tmp_path_factory) -> Path:
    """The folder every xdist worker of this test session shares."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def _session_lock(path: Path):
    from filelock import FileLock

    return FileLock(f"{path}.lock")


SHIPPED_PREREQUISITES = {
    # config: (the shipped config whose run makes its input, that run's export, where it goes)
    # tiny/full's 2-step export stands in for build_tiny_teacher's wider teacher (same tokenizer).
    "distill": ("full", "epoch_0", "outputs/tiny_teacher"),
    "distill_on_policy": ("full", "epoch_0", "outputs/tiny_teacher"),
    "grpo_learned_reward": ("reward_model", "epoch_0", "outputs/tiny_reward_model/epoch_0"),
    "agentic_grpo": ("agentic_sft", "epoch_0", "outputs/tiny_agentic_sft/epoch_4"),
}
"""Shipped tiny configs that read another run's output (their headers say which)."""


def shipped_config_run(tmp_path_factory, config: Path) -> tuple[Path, int, str]:
    """A shipped tiny ``config`` run once per test session as a user would run it.

    Outside make: without the ``TORCHAO_*`` and warning switches the suite sets, with a fresh
    ``datasets`` cache, started in a folder outside any git repository, on the processes its
    header names; a training recipe for one epoch of 2 steps (its own save settings), ``eval``
    on 2 documents, ``generate`` 4 tokens. test_quiet_runs checks what it printed; the old-flat-
    config test compares its training with this run's (the migrated twin). A config that reads
    another run's output (:data:`SHIPPED_PREREQUISITES`) gets a copy of that run's export.

    Returns:
        The run's folder (``{folder}/out`` is its output_dir; read-only), its exit code and
        everything it printed.
    """
    import yaml

    folder = _session_root(tmp_path_factory) / f"shipped_{config.stem}"
    done = folder.with_name(folder.name + ".done")
    prerequisite = SHIPPED_PREREQUISITES.get(config.stem)
    if prerequisite is not None:  # made first, outside this run's lock
        source_config, export, target = prerequisite
        source, source_code, _ = shipped_config_run(
            tmp_path_factory, config.with_name(f"{source_config}.yaml")
        )
    with _session_lock(folder):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            if prerequisite is not None and source_code == 0:
                # What the config's header says to make first, where the config reads it
                # (runs start in `folder`; copied: a run never reads through a link).
                shutil.copytree(source / "out" / export, folder / target)
            text = config.read_text()
            recipe = yaml.safe_load(text)["recipe"]
            if recipe == "generate":
                overrides = ["max_new_tokens=4"]
            elif recipe == "eval":
                overrides = [f"output_dir={folder / 'out'}", "limit=2"]
            else:  # One short epoch still validates, saves, exports and finishes like a full run.
                overrides = [
                    f"output_dir={folder / 'out'}", "schedule.epochs=1",
                    "schedule.max_steps_per_epoch=2",
                ]  # fmt: skip
            # Each config's header says how it is launched (`tunelab run --nproc_per_node 2 ...`).
            found = re.search(r"--nproc_per_node (\d+)", text)
            launcher = ["--nproc_per_node", found.group(1)] if found else []
            env = {
                key: value for key, value in os.environ.items() if not key.startswith("TORCHAO_")
            }
            env.pop("PYTHONWARNINGS", None)
            env.pop("TUNELAB_SHOW_LIBRARY_WARNINGS", None)
            env["OMP_NUM_THREADS"] = "1"  # What `tunelab run` sets for torchrun itself.
            # A new user's empty `datasets` cache: what it prints when it first prepares data.
            env["HF_DATASETS_CACHE"] = str(folder / "datasets_cache")
            command = [
                TUNELAB, "run", *launcher, recipe, "--config", f"tiny/{config.stem}", *overrides,
            ]  # fmt: skip
            result = subprocess.run(
                command, capture_output=True, text=True, env=env, timeout=RECIPE_TIMEOUT_S,
                cwd=folder,
            )  # fmt: skip
            launch_output(folder).write_text(result.stdout + result.stderr)
            done.write_text(str(result.returncode))
    return folder, int(done.read_text()), launch_output(folder).read_text()


def launch_output(out: Path) -> Path:
    """Where a shared run's printed output is kept (outside its output_dir)."""
    return out.with_name(out.name + ".out")


@pytest.fixture(scope="session")
def lora_2p(tmp_path_factory) -> Path:
    """``tiny/lora`` on one node, 2 processes of batch 8, COMMON settings (read-only: copy it)."""
    return shared_run(
        tmp_path_factory, "lora_2p", "lora_finetune_distributed", "tiny/lora", "schedule.batch_size=8",
        *COMMON,
    )  # fmt: skip


@pytest.fixture(scope="session")
def lora_1p(tmp_path_factory) -> Path:
    """``tiny/lora`` on 1 process of batch 16 (the global batch of ``lora_2p``), COMMON settings."""
    return shared_run(
        tmp_path_factory, "lora_1p", "lora_finetune_distributed", "tiny/lora", "schedule.batch_size=16",
        *COMMON, nproc=1,
    )  # fmt: skip


@pytest.fixture(scope="session")
def full_2p(tmp_path_factory) -> Path:
    """``tiny/full`` on one node, 2 processes of batch 8, COMMON settings (read-only: copy it)."""
    return shared_run(
        tmp_path_factory, "full_2p", "full_finetune_distributed", "tiny/full", "schedule.batch_size=8",
        *COMMON,
    )  # fmt: skip


# The tiny/lora_dpo run test_lora_dpo checks and the copied-recipe test compares with: DPO_STEPS
# uninterrupted steps on 2 processes with an async intermediate save at DPO_SAVE_AT, then export.
DPO_STEPS = 40
DPO_SAVE_AT = 20


@pytest.fixture(scope="session")
def dpo_2p(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    """The tiny/lora_dpo run (read-only) and its training rows of metrics.jsonl by step."""
    out = shared_run(
        tmp_path_factory, "dpo_2p", "lora_dpo_distributed", "tiny/lora_dpo",
        f"schedule.max_steps_per_epoch={DPO_STEPS}", f"checkpoint.save_every_n_steps={DPO_SAVE_AT}",
        "checkpoint.enable_async_checkpointing=true", "checkpoint.keep_last_n_checkpoints=null",
    )  # fmt: skip
    return out, {row["step"]: row for row in read_metrics(out) if "loss" in row}


# The tiny/lora run the checkpoint-trust and forged-field tests damage copies of: 2 processes of
# batch 8, a committed checkpoint every 2 steps (step_2, step_4, step_6), no validation.
EVERY_2 = [
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "schedule.batch_size=8",
    "schedule.run_val_every_n_steps=null",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=2",
    "checkpoint.keep_last_n_checkpoints=null",
]


@pytest.fixture(scope="session")
def lora_2p_every_2(tmp_path_factory) -> Path:
    """``tiny/lora`` with the EVERY_2 settings (read-only: copy it)."""
    return shared_run(
        tmp_path_factory, "lora_every_2", "lora_finetune_distributed", "tiny/lora", *EVERY_2
    )
