"""``tunelab export``: a GGUF file (and Ollama Modelfile) from an export or a step checkpoint.

With ``--nproc N`` the command starts N processes (one gloo group on this machine) that share
the writing as a run's own export does: each rank writes its own tensors' bytes at their
offsets in the one GGUF file, and for ``step_N/`` the model is sharded over them with FSDP2
(as ``tunelab run`` builds it) and each rank writes its rows of the Hugging Face export. The
files are byte-identical to one process's. The first process that fails stops the others
(a rank left alone would wait in a collective), and its one-line error is printed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tunelab.errors import TunelabError

_EPOCH = re.compile(r"^epoch_(\d+)$")
_STEP = re.compile(r"^step_\d+$")
# The same names as tunelab.formats.gguf_model.QUANTIZATIONS, without importing gguf for --help;
# export_gguf refuses a type the installed gguf package has no quantizer for, in one line.
_QUANTS = ("f16", "bf16", "f32", "q8_0", "q4_0", "q4_k", "q6_k")
# Set in the processes --nproc starts (with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT).
_WORKER_ENV = "TUNELAB_EXPORT_WORKER"
_POLL_S = 0.05


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the ``export`` subcommand."""
    parser = subparsers.add_parser(
        "export",
        parents=[parent],
        help="write a GGUF file (llama.cpp, Ollama, LM Studio) from an export",
        description="Convert a Hugging Face export (epoch_E/, for LoRA runs the merged model) "
        "to GGUF in EXPORT/gguf/: model-QUANT.gguf, an Ollama Modelfile and a manifest with "
        "their checksums. Given an output_dir, the newest epoch_E/ is used. The export is "
        "verified against its manifest first. Given a committed step checkpoint (step_N/) and "
        "the config of the run that made it (--config, with the run's overrides), the model "
        "the config builds takes the checkpoint's trained parameters (verified, and checked to "
        "be the config's model) and is exported to step_N_export/ as the run exports an epoch: "
        "Hugging Face (for LoRA the adapter and the merged model), then gguf/. With "
        "--nproc N, N processes share the writing (each its own tensors, at their offsets; "
        "for step_N/ the model sharded over them): the same bytes as one process.",
    )
    parser.add_argument("path", metavar="CHECKPOINT_OR_EXPORT", type=Path,
                        help="epoch_E/ (or any Hugging Face model folder), an output_dir, or step_N/")  # fmt: skip
    parser.add_argument("--to", required=True, choices=["gguf"], help="the format to write")
    parser.add_argument("--quant", default="f16", choices=_QUANTS, help="tensor type (default f16)")
    parser.add_argument("--config", nargs="+", metavar=("CONFIG", "OVERRIDE"),
                        help="for step_N/: the run's config and its overrides (key=value)")  # fmt: skip
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="processes that share the writing (default 1)")  # fmt: skip


def _export_folder(path: Path) -> Path:
    """The model folder ``path`` names: itself, or an output_dir's newest ``epoch_E/``."""
    if not path.is_dir():
        raise TunelabError(f"{path} is not a folder (give epoch_E/ or an output_dir)")
    if (path / "config.json").is_file():
        return path
    if path.name.startswith("step_"):
        raise TunelabError(f"{path} is not a step checkpoint folder (step_N/) nor a model export")
    epochs = [child for child in path.iterdir() if _EPOCH.match(child.name) and child.is_dir()]
    if not epochs:
        raise TunelabError(f"{path} holds no config.json and no epoch_E/ export")
    return max(epochs, key=lambda child: int(_EPOCH.match(child.name).group(1)))


def _export_step(step_dir: Path, quant: str, config: list[str]) -> Path:
    """Build the run's model from its config and export ``step_dir``'s state of it."""
    from tunelab.cli._check import load_recipe_config, recipe_of_config
    from tunelab.cli._discovery import load_recipe_args
    from tunelab.config import parse_args
    from tunelab.config.sections import ModelSetupArgs

    cfg, config_path, recipe_path = load_recipe_config(config[0], config[1:])
    recipe_path = recipe_path or recipe_of_config(cfg, config_path)
    args = parse_args(cfg, load_recipe_args(recipe_path))
    if not isinstance(getattr(args, "model", None), ModelSetupArgs):
        raise TunelabError(f"{config[0]}: recipe {recipe_path.stem} trains no model section")

    import torch

    from tunelab.checkpoint.step_export import export_step, read_step
    from tunelab.config import instantiate
    from tunelab.training import build_model

    read_step(step_dir)  # not committed: said before the model is loaded
    lora = getattr(args, "lora", None)
    model = build_model(args.model, device=torch.device("cpu"), lora=lora, seed=args.seed)
    tokenizer = instantiate(args.tokenizer)
    export = export_step(
        step_dir,
        model,
        base_checkpoint_dir=args.model.path,
        lora=lora,
        extra_files=tokenizer.extra_files() if hasattr(tokenizer, "extra_files") else None,
        gguf_quantization=quant,
    )
    return export / "gguf" / f"model-{quant}.gguf"


def run(namespace: argparse.Namespace) -> int:
    """Verify the export (or step checkpoint), then write its GGUF folder.

    Returns:
        The exit code, 0.

    Raises:
        TunelabError: If the path is no export, the export or checkpoint fails verification,
            the checkpoint was made for another model than the config builds, or the family,
            tokenizer or quantization is not supported (one line each).
    """
    from tunelab.formats.gguf_model import quantization_problem

    problem = quantization_problem(namespace.quant)
    if problem is not None:  # before a model is built or a file read
        raise TunelabError(problem)
    step = _STEP.match(namespace.path.name) and namespace.path.is_dir()
    if not step and namespace.config:
        raise TunelabError("--config is for a step checkpoint (step_N/); an export needs none")
    if step and not namespace.config:
        raise TunelabError(
            f"{namespace.path} is a training checkpoint (trainable parameters and optimizer "
            "state), not a model: give the config of the run that made it, --config CONFIG "
            "[OVERRIDE ...], to build its model, or export an epoch_E/ folder"
        )
    if namespace.nproc < 1:
        raise TunelabError(f"--nproc {namespace.nproc}: give 1 or more processes")
    if namespace.nproc > 1 and os.environ.get(_WORKER_ENV) != "1":
        return _launch(namespace)
    if os.environ.get(_WORKER_ENV) != "1":
        return _export(namespace, bool(step))

    from tunelab.distributed import destroy_distributed, init_distributed
    from tunelab.lifecycle import exit_with_launcher

    exit_with_launcher()
    init_distributed("cpu")
    try:
        return _export(namespace, bool(step))
    finally:
        destroy_distributed()


def _export(namespace: argparse.Namespace, step: bool) -> int:
    """Write the GGUF (and for a step the Hugging Face export) in this process or group."""
    if step:
        path = _export_step(namespace.path, namespace.quant, namespace.config)
        print(f"Wrote {path.parent.parent} (Hugging Face) and {path} and "
              f"{path.parent / 'Modelfile'} (ollama create NAME -f Modelfile)")  # fmt: skip
        return 0

    import torch.distributed as dist

    from tunelab.checkpoint.gguf_export import export_gguf
    from tunelab.formats.integrity import MANIFEST_NAME, verify_folder

    folder = _export_folder(namespace.path)
    if (folder / MANIFEST_NAME).is_file():
        # One process reads the export through; the others wait for its answer.
        problems = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:
            problems = verify_folder(folder)[:1] or [None]
        if dist.is_initialized():
            dist.broadcast_object_list(problems, src=0)
        if problems[0] is not None:
            raise TunelabError(f"{folder} fails verification: {problems[0]}")
    path = export_gguf(folder, quant=namespace.quant)
    print(f"Wrote {path} and {path.parent / 'Modelfile'} (ollama create NAME -f Modelfile)")
    return 0


def _launch(namespace: argparse.Namespace) -> int:
    """Run this export in ``--nproc`` processes; return 0, or print the first failure's line."""
    from tunelab.cli._run import _free_port
    from tunelab.lifecycle import LAUNCHER_PID_ENV

    argv = [str(namespace.path), "--to", namespace.to, "--quant", namespace.quant]
    if namespace.config:
        argv += ["--config", *namespace.config]
    if getattr(namespace, "debug", False):
        argv.append("--debug")
    count, port = namespace.nproc, _free_port()
    logs = Path(tempfile.mkdtemp(prefix="tunelab-export-"))
    children = []
    try:
        for rank in range(count):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(count),
                LOCAL_WORLD_SIZE=str(count),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS=os.environ.get(
                    "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // count))
                ),
            )
            env[_WORKER_ENV] = "1"
            env[LAUNCHER_PID_ENV] = str(os.getpid())  # The workers die with this process.
            with open(logs / f"rank_{rank}", "wb") as errors:
                children.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tunelab.cli", "export", *argv],
                        env=env,
                        stdout=None if rank == 0 else subprocess.DEVNULL,
                        stderr=errors,
                    )
                )
        codes: dict[int, int] = {}
        while len(codes) < count and not any(codes.values()):
            time.sleep(_POLL_S)
            codes |= {r: c.returncode for r, c in enumerate(children) if c.poll() is not None}
        failed = [rank for rank, code in sorted(codes.items()) if code != 0]
        if not failed:
            return 0
        # The first to fail stops the others: a rank left alone would wait in a collective.
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
        rank = failed[0]
        lines = (logs / f"rank_{rank}").read_text(errors="replace").splitlines()
        said = [line for line in lines if line.startswith("tunelab: error: ")]
        if getattr(namespace, "debug", False):
            print("\n".join(lines), file=sys.stderr)
        elif said:
            print(said[-1], file=sys.stderr)
        else:
            code = codes[rank]
            reason = f"exit code {code}" if code > 0 else f"signal {-code}"
            print(f"tunelab: error: export process {rank} of {count} failed ({reason})",
                  file=sys.stderr)  # fmt: skip
        return 1
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        shutil.rmtree(logs, ignore_errors=True)
