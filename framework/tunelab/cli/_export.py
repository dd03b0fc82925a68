"""``tunelab export``: a GGUF file (and Ollama Modelfile) from an existing Hugging Face export."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tunelab.errors import TunelabError

_EPOCH = re.compile(r"^epoch_(\d+)$")
# The same names as tunelab.formats.gguf_model.QUANTIZATIONS, without importing gguf for --help;
# export_gguf refuses a type the installed gguf package has no quantizer for, in one line.
_QUANTS = ("f16", "bf16", "f32", "q8_0", "q4_0", "q4_k", "q6_k")


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the ``export`` subcommand."""
    parser = subparsers.add_parser(
        "export",
        parents=[parent],
        help="write a GGUF file (llama.cpp, Ollama, LM Studio) from an export",
        description="Convert a Hugging Face export (epoch_E/, for LoRA runs the merged model) "
        "to GGUF in EXPORT/gguf/: model-QUANT.gguf, an Ollama Modelfile and a manifest with "
        "their checksums. Given an output_dir, the newest epoch_E/ is used. The export is "
        "verified against its manifest first.",
    )
    parser.add_argument("path", metavar="CHECKPOINT_OR_EXPORT", type=Path,
                        help="epoch_E/ (or any Hugging Face model folder), or an output_dir")  # fmt: skip
    parser.add_argument("--to", required=True, choices=["gguf"], help="the format to write")
    parser.add_argument("--quant", default="f16", choices=_QUANTS, help="tensor type (default f16)")


def _export_folder(path: Path) -> Path:
    """The model folder ``path`` names: itself, or an output_dir's newest ``epoch_E/``."""
    if not path.is_dir():
        raise TunelabError(f"{path} is not a folder (give epoch_E/ or an output_dir)")
    if (path / "config.json").is_file():
        return path
    if path.name.startswith("step_"):
        raise TunelabError(
            f"{path} is a resumable training checkpoint, not a model: export from the "
            "epoch_E/ folder a run writes at each epoch end"
        )
    epochs = [child for child in path.iterdir() if _EPOCH.match(child.name) and child.is_dir()]
    if not epochs:
        raise TunelabError(f"{path} holds no config.json and no epoch_E/ export")
    return max(epochs, key=lambda child: int(_EPOCH.match(child.name).group(1)))


def run(namespace: argparse.Namespace) -> int:
    """Verify the export, then write its GGUF folder.

    Returns:
        The exit code, 0.

    Raises:
        TunelabError: If the path is no export, the export fails verification, or the family,
            tokenizer or quantization is not supported (one line each).
    """
    from tunelab.checkpoint.gguf_export import export_gguf
    from tunelab.formats.integrity import MANIFEST_NAME, verify_folder

    folder = _export_folder(namespace.path)
    if (folder / MANIFEST_NAME).is_file():
        problems = verify_folder(folder)
        if problems:
            raise TunelabError(f"{folder} fails verification: {problems[0]}")
    path = export_gguf(folder, quant=namespace.quant)
    print(f"Wrote {path} and {path.parent / 'Modelfile'} (ollama create NAME -f Modelfile)")
    return 0
