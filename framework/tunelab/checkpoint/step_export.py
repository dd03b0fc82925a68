"""Export a committed step checkpoint (``step_N/``) as a model: Hugging Face and GGUF.

A step checkpoint holds training state, not a model: the trainable parameters (for LoRA the
adapter alone; the frozen base is the run's base model), the optimizer state and the trainer
state. ``export_step`` puts the trained parameters into the model the run's config builds and
writes it as the run's epoch exports are written (``export_hf``: for LoRA the adapter first,
then the merged model, merged out of place; then ``export_gguf``), into
``{output_dir}/step_N_export/`` (``RunFolder.step_export_dir``): the committed ``step_N/``
itself is never written to.

Trust, as for a resume: the checkpoint must be committed; its manifest's fingerprint must
match the model (base config, LoRA setup, trainable parameters); every file is verified
against its checksums before anything is loaded (the optimizer state too, which the export does
not read: a step with any damage is refused, as a resume would move it aside), and the model's
tensor bytes again as the load reads them. Both exports are written beside their final place
and renamed into it, so an interrupted export leaves the previous one or none.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from tunelab.checkpoint._tensor_files import ContentMismatch
from tunelab.checkpoint.client import fingerprint_mismatch, model_fingerprint
from tunelab.checkpoint.dcp import SafeReader, load, paused_garbage_collection
from tunelab.checkpoint.export import export_hf
from tunelab.checkpoint.state import TRAINER_STATE_NAME
from tunelab.config.lora import LoRAArgs
from tunelab.errors import CheckpointError
from tunelab.formats import integrity, layout
from tunelab.lifecycle.run_folder import CommittedCheckpoint, RunFolder

__all__ = ["export_step", "read_step"]

_STEP = re.compile(r"^step_(\d+)$")


def read_step(step_dir: str | os.PathLike) -> CommittedCheckpoint:
    """The committed step checkpoint at ``step_dir``.

    Raises:
        CheckpointError: If it is not a ``step_N`` folder with a readable manifest.
    """
    path = Path(step_dir)
    match = _STEP.match(path.name)
    if match is None or not path.is_dir() or path.is_symlink():
        raise CheckpointError(f"{path} is not a step checkpoint folder (step_N/)")
    manifest = layout.read_manifest(path)
    if manifest is None:
        raise CheckpointError(
            f"{path} is not a committed checkpoint (no manifest): its save did not finish"
        )
    return CommittedCheckpoint(int(match.group(1)), path, manifest)


def _load_model_state(checkpoint: CommittedCheckpoint, model: nn.Module) -> None:
    """Verify ``checkpoint`` and load its model tensors (not the optimizer's) into ``model``."""
    files = checkpoint.manifest["files"]
    # Every byte, the optimizer state's too, although the export reads only the model's: a
    # step with any damage is refused, as a resume moves it aside (tunelab verify's check).
    problems = integrity.problems_in(checkpoint.path, files)
    problems += integrity.unlisted_files(checkpoint.path, files)
    if TRAINER_STATE_NAME not in files:
        problems.append(f"{checkpoint.path / TRAINER_STATE_NAME}: not listed in the manifest")
    if problems:
        raise CheckpointError(f"{checkpoint.path} fails verification: {problems[0]}")
    reader = SafeReader(checkpoint.path, files)
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    state = get_model_state_dict(model, options=options)
    saved = set(reader.read_metadata().state_dict_metadata)
    missing = sorted(f"model.{key}" for key in state if f"model.{key}" not in saved)
    if missing:
        raise CheckpointError(
            f"{checkpoint.path} does not hold {missing[0]} (and {len(missing) - 1} more): it was "
            "made for another model or adapter"
        )
    try:
        with paused_garbage_collection(), warnings.catch_warnings():
            # One process without a group (tunelab export) is a supported case here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            load({"model": state}, checkpoint.path, files, reader=reader)
    except ContentMismatch as error:
        raise CheckpointError(f"{checkpoint.path} fails verification: {error}") from error
    set_model_state_dict(model, state, options=options)


def export_step(
    step_dir: str | os.PathLike,
    model: nn.Module,
    *,
    base_checkpoint_dir: str | os.PathLike,
    lora: LoRAArgs | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    gguf_quantization: str | None = "f16",
) -> Path:
    """Write ``step_N``'s model to ``step_N_export/`` (Hugging Face, and GGUF when asked).

    Args:
        step_dir: A committed ``step_N/`` of a run.
        model: The run's model as its config builds it (base weights loaded, adapters fresh):
            the checkpoint's trainable parameters replace its own.
        base_checkpoint_dir: The run's base model folder (``model.path``).
        lora: The run's LoRA settings, None for full fine-tuning.
        extra_files: Files the run's exports write beside the tokenizer files
            (``Tokenizer.extra_files()``).
        gguf_quantization: Also write ``gguf/`` with this tensor type; None writes none.

    Returns:
        The export folder.

    Raises:
        CheckpointError: One line when the checkpoint is not committed, was made for another
            model, or fails verification, when the export folder is a link, or when the GGUF
            cannot be written.
    """
    checkpoint = read_step(step_dir)
    base_checkpoint_dir = Path(base_checkpoint_dir)
    problem = fingerprint_mismatch(checkpoint, model_fingerprint(model, base_checkpoint_dir, lora))
    if problem is not None:
        raise CheckpointError(f"{problem}: export it with the config of the run that made it")
    _load_model_state(checkpoint, model)
    target = RunFolder(checkpoint.path.parent).step_export_dir(checkpoint.step)
    if target.is_symlink():
        raise CheckpointError(
            f"{target} is a link; tunelab never writes through links in an output_dir: remove it"
        )
    export_hf(
        model, target, base_checkpoint_dir=base_checkpoint_dir, lora=lora, extra_files=extra_files
    )
    if gguf_quantization is not None:
        # Imported here: the gguf package is needed only when a GGUF is asked for.
        from tunelab.checkpoint.gguf_export import export_gguf

        export_gguf(target, quant=gguf_quantization)
    return target
