"""``tunelab run``: validate, then launch a recipe on 1 process or through torchrun."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

from tunelab.cli._check import check_config
from tunelab.config._entry import _recipe_parser

USAGE = """\
usage: tunelab run [TORCHRUN OPTIONS] RECIPE --config CONFIG [OVERRIDE ...]

Validate CONFIG against RECIPE's settings, then run it.

  RECIPE      a built-in recipe name (`tunelab ls`) or a path to a .py file
  CONFIG      a built-in config name or a path to a YAML file
  OVERRIDE    key=value, a.b.c=value or ~key

Without torchrun options the recipe runs as one process (RANK=0, WORLD_SIZE=1). With them
(--nproc_per_node 2, --nnodes, --rdzv-endpoint, --master-port, ...: see `torchrun --help`) it
is launched through torch.distributed.run; a single-node launch without a rendezvous endpoint
or master port gets a free port of its own.
"""

# torchrun's loud INFO/WARNING lines (rendezvous banners, "failed (exitcode...)") repeat what
# the recipe and this command already say; --debug brings them back.
_ELASTIC_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.run",
    "torch.distributed.launcher",
)


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the ``run`` subcommand; its arguments are parsed by ``run`` itself."""
    parser = subparsers.add_parser(
        "run",
        add_help=False,
        help="validate a config and run a recipe (1 process, or N through torchrun)",
        usage="tunelab run [TORCHRUN OPTIONS] RECIPE --config CONFIG [OVERRIDE ...]",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_one_process(recipe: Path, child_args: list[str], debug: bool) -> int:
    # The same environment torchrun gives a 1-process job, so the recipe takes one code path.
    env = dict(
        os.environ,
        RANK="0",
        LOCAL_RANK="0",
        GROUP_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    if debug:
        env["TUNELAB_DEBUG"] = "1"
    try:
        completed = subprocess.run([sys.executable, str(recipe), *child_args], env=env)
    except KeyboardInterrupt:
        return 130
    code = completed.returncode
    if code != 0:
        reason = f"exit code {code}" if code > 0 else f"signal {-code}"
        print(f"tunelab: error: recipe {recipe.stem} failed ({reason})", file=sys.stderr)
        return code if code > 0 else 128 - code
    return 0


def _describe_failure(recipe: str, failures: dict) -> str:
    """One line for a failed torchrun job, naming the rank that failed first."""

    def recorded(failure) -> bool:  # The rank raised a TunelabError and wrote its message.
        return failure.exitcode > 0 and bool(failure.error_file_data.get("message"))

    if 0 in failures and recorded(failures[0]):
        # Rank 0 printed its own message; don't repeat it.
        return f"recipe {recipe} failed on rank 0 (exit code {failures[0].exitcode})"
    # Ranks torchrun stopped after the first failure come back with a signal; skip them.
    rank, failure = min(
        failures.items(), key=lambda item: (item[1].exitcode <= 0, item[1].timestamp, item[0])
    )
    code = failure.exitcode
    reason = f"exit code {code}" if code > 0 else f"signal {-code}"
    if recorded(failure):
        message = failure.error_file_data["message"]
        message = message.get("message", "") if isinstance(message, dict) else message
        return f"recipe {recipe} failed on rank {rank}: {message}"
    return f"recipe {recipe} failed on rank {rank} ({reason})"


def _run_torchrun(
    torchrun_args: list[str], recipe: Path, child_args: list[str], debug: bool
) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog = "tunelab run"
    launch = parser.parse_args([*torchrun_args, str(recipe), *child_args])
    defaults = parser.parse_args(["recipe.py"])
    rendezvous_keys = ("rdzv_endpoint", "rdzv_backend", "master_addr", "master_port", "nnodes")
    if not any(getattr(launch, key) != getattr(defaults, key) for key in rendezvous_keys) and not (
        os.environ.keys() & {"PET_RDZV_ENDPOINT", "PET_MASTER_PORT", "PET_MASTER_ADDR"}
    ):
        # A rendezvous on a free local port, so parallel runs on one machine never collide.
        launch.standalone = True
    if debug:
        os.environ["TUNELAB_DEBUG"] = "1"
    else:
        for name in _ELASTIC_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # torchrun would set this with a boxed warning when several processes share a node.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run(launch)
    except ChildFailedError as err:
        print(f"tunelab: error: {_describe_failure(recipe.stem, err.failures)}", file=sys.stderr)
        codes = [f.exitcode for _, f in sorted(err.failures.items()) if 0 < f.exitcode < 256]
        return codes[0] if codes else 1
    return 0


def run_command(argv: list[str], debug: bool) -> int:
    """Run ``tunelab run`` with its raw arguments.

    Args:
        argv: Everything after ``run``.
        debug: Whether tracebacks and torchrun's logs should show.

    Returns:
        The exit code: the recipe's (non-zero on failure).

    Raises:
        TunelabError: If the recipe or config is missing or the config does not validate.
    """
    if "--debug" in argv:
        argv = [arg for arg in argv if arg != "--debug"]
        debug = True
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0].startswith("-"):
        torchrun_args, recipe, recipe_args = _split_torchrun(argv)
    else:  # No torchrun options: no need to import torch here.
        torchrun_args, recipe, recipe_args = [], argv[0], argv[1:]
    recipe_parser = _recipe_parser()
    recipe_parser.prog = f"tunelab run {recipe}"
    recipe_cli = recipe_parser.parse_intermixed_args(recipe_args)
    config_path, recipe_path = check_config(recipe_cli.config, recipe_cli.overrides, recipe)
    child_args = ["--config", str(config_path.resolve()), *recipe_cli.overrides]
    if torchrun_args:
        return _run_torchrun(torchrun_args, recipe_path.resolve(), child_args, debug)
    return _run_one_process(recipe_path.resolve(), child_args, debug)


def _split_torchrun(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """Split ``[torchrun options] RECIPE [recipe args]`` into its three parts."""
    # torch's own parser knows which options take values, so it finds where the recipe starts.
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "tunelab run"
    parser.usage = USAGE.splitlines()[0].removeprefix("usage: ")
    for action in parser._actions:  # Name torch's positionals as this command does.
        if action.dest == "training_script":
            action.metavar = "RECIPE"
        elif action.dest == "training_script_args":
            action.metavar = "--config CONFIG"
    launch = parser.parse_args(argv)
    split = len(argv) - len(launch.training_script_args) - 1
    assert argv[split] == launch.training_script
    return argv[:split], launch.training_script, launch.training_script_args
