"""Helpers for tests that launch real multi-process runs."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

BIN_DIR = Path(sys.executable).parent
TUNELAB = str(BIN_DIR / "tunelab")
RECIPE_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    env["OMP_NUM_THREADS"] = "1"
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
        command, capture_output=True, text=True, env=run_env(), timeout=RECIPE_TIMEOUT_S,
        **popen_kwargs,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def tunelab_run(recipe: str, config: str, *overrides: str, nproc: int = 2, check: bool = True):
    """Launch the real ``tunelab run`` (``nproc`` 1 runs without torchrun options)."""
    launcher = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    command = [TUNELAB, "run", *launcher, recipe, "--config", config, *overrides]
    result = subprocess.run(
        command, capture_output=True, text=True, env=run_env(), timeout=RECIPE_TIMEOUT_S
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    return result


def interrupted_copy(source: Path, target: Path, *, after_step: int) -> Path:
    """``source`` as a run killed right after committing step ``after_step`` would leave it."""
    shutil.copytree(source, target)
    for path in target.iterdir():
        if path.name.startswith("step_") and int(path.name.split("_")[1]) > after_step:
            shutil.rmtree(path)
        elif path.name.startswith("epoch_") or path.name == "logs":
            shutil.rmtree(path)
    return target


def read_metrics(output_dir: Path) -> list[dict]:
    """Every record of ``{output_dir}/logs/metrics.jsonl``."""
    path = Path(output_dir) / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses_by_step(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(output_dir) if "loss" in r}
