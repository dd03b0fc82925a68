"""``CheckpointClient``: the only checkpoint object recipes touch.

Lifecycle (see docs/checkpointing.md):

1. Built after the process group exists (a multi-process run without one is an error).
2. :meth:`save` writes a resumable DCP checkpoint of the trainable state into
   ``step_{N}/``; with async checkpointing it returns at once, the state is staged to CPU
   while the next forward and backward run, and the optimizer step waits for the staging.
3. Every save, export and :meth:`close` first waits for the save in flight.
4. A step directory counts once rank 0 has committed it (an atomic manifest), after every
   rank's files are durable; retention then prunes older committed ones.
5. :meth:`export` writes ``epoch_{E}/``: for LoRA the PEFT adapter first, then the merged
   model, merged shard-locally out of place and written by every rank in parallel.
6. :meth:`load_latest` verifies the newest committed checkpoint against its checksums, moves
   a bad one aside (``step_N.corrupt-<time>``) with a warning, and restores the newest good
   one at any world size.
"""

import hashlib
import json
import logging
import os
import platform
import shutil
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from tunelab._model_files import read_model_bytes
from tunelab.checkpoint._dcp_json import METADATA_JSON_NAME
from tunelab.checkpoint._tensor_files import ContentMismatch
from tunelab.checkpoint.dcp import (
    DCPSaver,
    FileRecords,
    SafeReader,
    WriterFactory,
    as_checkpoint_error,
    load,
    paused_garbage_collection,
)
from tunelab.checkpoint.export import export_hf
from tunelab.checkpoint.state import (
    TRAINER_STATE_NAME,
    gather_rng_states,
    restore_rng_states,
    to_json,
    trainer_state_problem,
)
from tunelab.config.lora import LoRAArgs
from tunelab.errors import CheckpointError, first_line
from tunelab.formats import integrity, layout
from tunelab.lifecycle.run_folder import CommittedCheckpoint, RunFolder
from tunelab.peft import lora_target_names

logger = logging.getLogger(__name__)
_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# The saved state holds trainable parameters only (for LoRA, the adapter); the frozen base
# comes from the base checkpoint, so loading must not demand the frozen keys.
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


@dataclass(frozen=True)
class ResumeState:
    """What :meth:`CheckpointClient.load_latest` hands back to the recipe."""

    step: int
    """The global step the checkpoint was taken after."""
    epoch: int
    """The epoch it was taken in."""
    progress: dict[str, Any]
    """The recipe's own progress record (sampler position, step in epoch, ...)."""
    path: Path
    """The step directory it came from."""


class CheckpointClient:
    """Saves, commits, exports and restores a run's checkpoints.

    Args:
        run: The run's folder (``step_{N}/``, ``epoch_{E}/`` go there), or its path.
        model: The (possibly FSDP2-sharded) model.
        optimizer: Its optimizer.
        lr_scheduler: Its LR scheduler, or None.
        base_checkpoint_dir: The Hugging Face folder the model was loaded from (config,
            tokenizer and file names of exports come from it).
        lora: The LoRA settings for LoRA recipes, None for full fine-tuning.
        enable_async: Release the trainer at once; stage during the next forward and
            backward (the optimizer step waits for it), write in the background.
        keep_last_n: Keep this many committed step checkpoints (None keeps all).
        config_hash: Hash of the resolved run config, recorded in manifests.
        writer_factory: Storage writer for step checkpoints (tests inject slow writers).
        export_files: Files every export writes beside the base model's tokenizer files, by
            name (``Tokenizer.extra_files()``: the chat template a run was trained with).
        gguf_quantization: Also write each export as GGUF (``epoch_{E}/gguf/``) with this
            tensor type (``tunelab.checkpoint.gguf_export``); None writes no GGUF.

    Raises:
        CheckpointError: A multi-process run built the client before the process group.
    """

    def __init__(
        self,
        run: RunFolder | str | os.PathLike,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any | None,
        base_checkpoint_dir: str | os.PathLike,
        lora: LoRAArgs | None = None,
        enable_async: bool = False,
        keep_last_n: int | None = None,
        config_hash: str = "",
        writer_factory: WriterFactory | None = None,
        export_files: Mapping[str, bytes] | None = None,
        gguf_quantization: str | None = None,
    ) -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            raise CheckpointError(
                "CheckpointClient was built before the process group: call "
                "tunelab.distributed.init_distributed() first in a multi-process run"
            )
        self.run = run if isinstance(run, RunFolder) else RunFolder(run)
        self.output_dir = self.run.root
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.base_checkpoint_dir = Path(base_checkpoint_dir)
        self.lora = lora
        self.keep_last_n = keep_last_n
        self.config_hash = config_hash
        self.export_files = dict(export_files or {})
        self.gguf_quantization = gguf_quantization
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._saver = DCPSaver(enable_async=enable_async, writer_factory=writer_factory)
        self._pruning: threading.Thread | None = None
        self._readers: dict[Path, SafeReader] = {}
        self._prune_error: BaseException | None = None
        self._fingerprint = self._make_fingerprint()
        self._remove_stale()
        # An async save stages the state while the next forward and backward run; the
        # optimizer step is the first thing that changes it.
        self._step_hook = optimizer.register_step_pre_hook(
            lambda *_: self._saver.wait_for_staging()
        )

    # -- intermediate, resumable checkpoints -------------------------------------------

    def save(
        self, step: int, epoch: int, progress: dict[str, Any], *, blocking: bool = False
    ) -> Path:
        """Save the resumable state after ``step`` into ``step_{step}/``.

        Waits for the save in flight first. With async checkpointing, returns as soon as
        staging has started; the optimizer's next step waits for it to finish, and the step
        is committed when its write completes.

        Args:
            step: The global optimizer step just completed.
            epoch: The current epoch.
            progress: JSON-able progress of the recipe (sampler position, step in epoch).
            blocking: Write synchronously even with async checkpointing (the last save of a
                run: nothing is left to overlap it with).

        Returns:
            The step directory.
        """
        self.wait()
        path = self.run.step_dir(step)
        if path.is_symlink():
            # Writing (or clearing) it would reach into whatever it points at.
            raise CheckpointError(
                f"{path} is a link; tunelab never writes through links in an output_dir: remove it"
            )
        if layout.read_manifest(path) is not None:
            # Overwriting a committed checkpoint in place would break it mid-write.
            raise CheckpointError(f"{path} is already a committed checkpoint")
        tensors, param_groups = self._tensor_state()
        trainer_state = to_json(
            {
                "step": step,
                "epoch": epoch,
                "progress": progress,
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
                "optimizer_param_groups": param_groups,
                "rng": gather_rng_states(),
            }
        )
        trainer_record = None
        failure: list[Any] = [None]
        if self.rank == 0:
            # A folder left by a crashed save is written afresh, so the manifest lists only
            # this save's files.
            try:
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir(parents=True, exist_ok=True)
                layout.write_atomic(path / TRAINER_STATE_NAME, trainer_state)
            except OSError as error:
                failure = [str(as_checkpoint_error(error, path, "writing checkpoint"))]
            trainer_record = integrity.record_of(trainer_state)
        # The other ranks touch the folder only after this (DCP's writer creates it on every
        # rank: a rank creating it while rank 0 cleared it failed one CI run with "step_6:
        # File exists"), and all raise rank 0's failure instead of waiting in DCP's planning.
        self._broadcast(failure)
        if failure[0] is not None:
            raise CheckpointError(failure[0])
        manifest = {"step": step, "epoch": epoch, **self._manifest_common()}

        def commit(records: FileRecords) -> None:
            self._commit(path, manifest, {**records, TRAINER_STATE_NAME: trainer_record})

        self._saver.save(tensors, path, on_done=commit, blocking=blocking)
        return path

    def _commit(self, path: Path, manifest: dict[str, Any], files: FileRecords) -> None:
        if self.rank != 0:
            return
        if METADATA_JSON_NAME not in files:
            raise CheckpointError(
                f"{path}: the storage writer recorded no checksums (use "
                "tunelab.checkpoint.dcp.ChecksummedWriter); not committing"
            )
        try:
            layout.commit(path, manifest, files)
        except OSError as error:
            raise as_checkpoint_error(error, path, "writing checkpoint") from error
        logger.info("committed checkpoint %s", path)
        if self.keep_last_n is not None:
            # Deleting superseded checkpoints is off the save's path (0.17 s per 0.5 GB
            # here, a third of the save): a thread, joined by the next save, wait and close.
            self._join_prune()
            self._pruning = threading.Thread(target=self._prune, name="tunelab-prune")
            self._pruning.start()

    def _prune(self) -> None:
        try:
            for deleted in self.run.prune(self.keep_last_n or 0):
                logger.info("pruned checkpoint %s", deleted)
        except OSError as error:
            self._prune_error = as_checkpoint_error(error, self.output_dir, "pruning checkpoints")

    def _join_prune(self) -> None:
        """Wait for the pruning in flight; raise its error."""
        thread, self._pruning = self._pruning, None
        if thread is not None:
            thread.join()
        error, self._prune_error = self._prune_error, None
        if error is not None:
            raise error

    def _tensor_state(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        # Hyper-parameters (lr, betas, ...) go to the JSON trainer state: DCP would pickle them.
        param_groups = optim_sd.pop("param_groups")
        return {"model": model_sd, "optimizer": optim_sd}, param_groups

    def wait(self) -> None:
        """Block until the save in flight is committed and superseded ones are deleted."""
        self._saver.wait()
        self._join_prune()

    def wait_for_staging(self) -> None:
        """Block until the save in flight has copied the parameters and optimizer state.

        The optimizer step waits for this by itself (a pre-step hook); call it before any
        other in-place change of parameters, e.g. swapping adapter weights.
        """
        self._saver.wait_for_staging()

    # -- resume ------------------------------------------------------------------------

    def load_latest(self) -> ResumeState | None:
        """Verify and restore the newest committed checkpoint into the model and optimizer.

        Every byte of the newest committed checkpoint is checked against the checksums in its
        manifest, each read once: the small files before anything is loaded (the ranks split
        them), the tensor data as the load reads it, and any range no rank read right after.
        A checkpoint that fails, or whose manifest is unreadable, is named in one warning, moved
        aside to
        ``step_N.corrupt-<time>`` (so reaching step N again commits a new ``step_N``), and the
        next older one is tried.

        Returns:
            Where training stopped, or None when there is no committed checkpoint.

        Raises:
            CheckpointError: The checkpoint was made with another base model, LoRA setup or
                recipe, cannot be loaded although its checksums match, or every committed
                checkpoint failed verification.
        """
        try:
            with paused_garbage_collection():  # its many small objects: docs in dcp.py
                return self._load_newest_intact()
        finally:
            self._readers = {}  # each resume parses what it reads afresh

    def _load_newest_intact(self) -> ResumeState | None:
        candidates: list[Any] = [None]
        if self.rank == 0:
            committed, unreadable = self.run.scan_checkpoints()
            found = [(c.step, c.path, c.manifest, None) for c in committed]
            found += [(c.step, c.path, None, c.reason) for c in unreadable]
            candidates = [sorted(found, key=lambda item: item[0], reverse=True)]
        # One view of the folder for every rank: rank 0 moves bad ones aside below.
        self._broadcast(candidates)
        moved = []
        for step, path, manifest, problem in candidates[0]:
            if manifest is not None:
                checkpoint = CommittedCheckpoint(step, path, manifest)
                self._check_fingerprint(checkpoint)
                problem = self._verify(checkpoint)
                if problem is None:
                    try:
                        return self._load(checkpoint)
                    except ContentMismatch as error:  # the same on every rank
                        problem = str(error)
            # Every rank names it (the problem is the same everywhere), so the one error line
            # is the same whichever rank's error the launcher reports.
            # The checkpoint's own path once, not in each of its files' problems, and each
            # problem's start (the file and what is wrong): the line names every checkpoint.
            brief = problem.replace(f"{path}/", "")
            brief = brief if len(brief) <= 50 else brief[:47] + "..."
            moved.append(f"{path.name} ({brief})")
            if self.rank == 0:
                aside = layout.move_aside(path)
                logger.warning(
                    "skipping checkpoint %s, which failed verification: %s; moved it to %s",
                    path.name,
                    problem,
                    aside.name,
                )
        if candidates[0]:
            raise CheckpointError(
                f"no intact committed checkpoint in {self.output_dir}: " + "; ".join(moved)
                if moved
                else f"no intact committed checkpoint in {self.output_dir}"
            )
        return None

    def _verify(self, checkpoint: CommittedCheckpoint) -> str | None:
        """Check ``checkpoint``'s files against their checksums, ranks sharing the reads.

        The raw tensor files are left to the load, which verifies their bytes as it reads
        them (:meth:`_load`): each byte is read once. Everything else (the metadata, the
        trainer state, tensor files of the ``torch.save`` format) is verified here.

        Returns:
            The same on every rank: None, or the first problem (and how many more).
        """
        files = checkpoint.manifest["files"]
        streamed = _streamed_files(self._reader(checkpoint), files)
        names = sorted(name for name in files if name not in streamed)
        problems = integrity.problems_in(
            checkpoint.path, files, names=names[self.rank :: self.world_size]
        )
        if self.rank == 0:
            required = (METADATA_JSON_NAME, TRAINER_STATE_NAME)
            problems += [
                f"{checkpoint.path / name}: not listed in the manifest"
                for name in required
                if name not in files
            ]
            problems += integrity.unlisted_files(checkpoint.path, files)
            # Fields are checked before use: a forged state falls back like a corrupt one.
            state_problem = trainer_state_problem(
                checkpoint.path / TRAINER_STATE_NAME, checkpoint.step
            )
            problems += [state_problem] if state_problem else []
        return self._first_problem(problems)

    def _first_problem(self, problems: list[str]) -> str | None:
        """Every rank's ``problems`` gathered: None, or the first (and how many more)."""
        everything = [
            problem for rank_problems in self._gather(problems) for problem in rank_problems
        ]
        if not everything:
            return None
        more = f" (and {len(everything) - 1} more)" if len(everything) > 1 else ""
        return everything[0] + more

    def _gather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order (on the checkpoint's own group)."""
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self._saver.process_group)
        return gathered

    def _verify_unread(
        self, checkpoint: CommittedCheckpoint, verified: set[tuple[str, int]]
    ) -> None:
        """Verify the ranges of the raw tensor files that no rank's load read.

        Raises:
            ContentMismatch: If one differs from its checksum (on every rank).
        """
        files = checkpoint.manifest["files"]
        ranges = [
            (name, offset)
            for name in sorted(_streamed_files(self._reader(checkpoint), files))
            for offset, _, _ in files[name]["ranges"]
        ]
        read = torch.tensor([key in verified for key in ranges], dtype=torch.uint8)
        if self.world_size > 1:  # read by any rank
            dist.all_reduce(read, op=dist.ReduceOp.MAX, group=self._saver.process_group)
        unread = [key for key, done in zip(ranges, read.tolist(), strict=True) if not done]
        problems = []
        for name, offset in unread[self.rank :: self.world_size]:
            problem = integrity.check_file(checkpoint.path / name, files[name], only={offset})
            problems += [f"{checkpoint.path / name}: {problem}"] if problem else []
        problem = self._first_problem(problems)
        if problem is not None:
            raise ContentMismatch(problem)

    def _reader(self, checkpoint: CommittedCheckpoint) -> SafeReader:
        """The one reader of ``checkpoint`` during a resume (its metadata parsed once)."""
        if self._readers.get(checkpoint.path) is None:
            self._readers = {
                checkpoint.path: SafeReader(checkpoint.path, checkpoint.manifest["files"])
            }
        return self._readers[checkpoint.path]

    def _broadcast(self, objects: list[Any]) -> None:
        if self.world_size > 1:
            dist.broadcast_object_list(objects, src=0, group=self._saver.process_group)

    def _remove_stale(self) -> None:
        """Delete what a killed run left: uncommitted step folders, temporary files."""
        failure: list[Any] = [None]
        if self.rank == 0:
            try:
                for path in self.run.remove_leftovers():
                    logger.info("removed %s, left by an interrupted run", path)
            except OSError as error:
                failure = [str(as_checkpoint_error(error, self.output_dir, "cleaning"))]
        self._broadcast(failure)
        if failure[0] is not None:
            raise CheckpointError(failure[0])

    def _load(self, checkpoint: CommittedCheckpoint) -> ResumeState:
        reader = self._reader(checkpoint)
        reader.prefetch(self.rank, self.world_size)  # the disk reads while the load plans
        trainer_state = json.loads((checkpoint.path / TRAINER_STATE_NAME).read_text())
        tensors, param_groups = self._tensor_state()
        saved = set(reader.read_metadata().state_dict_metadata)
        missing = {f"model.{key}" for key in tensors["model"]} - saved
        if missing:
            raise CheckpointError(
                f"{checkpoint.path} does not hold {sorted(missing)[0]} "
                f"(and {len(missing) - 1} more): it was made for another model or adapter"
            )
        try:
            verified = load(tensors, checkpoint.path, checkpoint.manifest["files"], reader=reader)
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(
                f"{checkpoint.path} passed verification but cannot be loaded: "
                f"{type(error).__name__}: {first_line(error)}"
            ) from error
        self._verify_unread(checkpoint, verified)
        for group, saved in zip(param_groups, trainer_state["optimizer_param_groups"], strict=True):
            group.update({key: value for key, value in saved.items() if key != "params"})
        optim_sd = {**tensors["optimizer"], "param_groups": param_groups}
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=tensors["model"],
            optim_state_dict=optim_sd,
            options=_LOAD_OPTIONS,
        )
        if self.lr_scheduler is not None and trainer_state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(trainer_state["lr_scheduler"])
        restore_rng_states(trainer_state["rng"])
        return ResumeState(
            step=trainer_state["step"],
            epoch=trainer_state["epoch"],
            progress=trainer_state["progress"],
            path=checkpoint.path,
        )

    def _check_fingerprint(self, checkpoint: CommittedCheckpoint) -> None:
        problem = fingerprint_mismatch(checkpoint, self._fingerprint)
        if problem is not None:
            raise CheckpointError(
                f"{problem}. Use another output_dir or set checkpoint.resume_from_checkpoint=false."
            )

    # -- export ------------------------------------------------------------------------

    def export(self, epoch: int) -> Path:
        """Write ``epoch_{epoch}/`` in Hugging Face format (and ``adapter/`` for LoRA, ``gguf/``).

        Waits for the save in flight first. Never modifies live parameters.

        Returns:
            The export folder.
        """
        self._saver.wait()
        path = self.run.epoch_dir(epoch)
        if path.is_symlink():
            raise CheckpointError(
                f"{path} is a link; tunelab never writes through links in an output_dir: remove it"
            )
        try:
            export_hf(
                self.model,
                path,
                base_checkpoint_dir=self.base_checkpoint_dir,
                lora=self.lora,
                extra_files=self.export_files,
            )
            if self.gguf_quantization is not None:
                # Imported here: the gguf package is needed only by runs that export GGUF.
                from tunelab.checkpoint.gguf_export import export_gguf

                # From the merged weights just written: each rank converts its share of them.
                export_gguf(path, quant=self.gguf_quantization)
            return path
        except OSError as error:
            raise as_checkpoint_error(error, path, "exporting") from error

    def close(self) -> None:
        """Wait for the save in flight, then release the checkpoint process group."""
        self._step_hook.remove()
        try:
            self._saver.close()
        finally:
            self._join_prune()

    # -- manifest ----------------------------------------------------------------------

    def _make_fingerprint(self) -> dict[str, Any]:
        return model_fingerprint(self.model, self.base_checkpoint_dir, self.lora)

    def _manifest_common(self) -> dict[str, Any]:
        import tunelab

        return {
            "world_size": self.world_size,
            "config_hash": self.config_hash,
            "fingerprint": self._fingerprint,
            "versions": {
                "tunelab": tunelab.__version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
        }


def model_fingerprint(
    model: nn.Module, base_checkpoint_dir: Path, lora: LoRAArgs | None
) -> dict[str, Any]:
    """The manifest ``fingerprint`` of a step checkpoint of ``model``.

    The base config's hash, the LoRA setup and the trainable parameters' names and shapes:
    what must match for the checkpoint's state to fit the model.
    """
    config_path = base_checkpoint_dir / "config.json"
    base_hash = (
        hashlib.sha256(read_model_bytes(config_path)).hexdigest()[:16]
        if config_path.is_file()
        else None
    )
    trainable = sorted(
        (name, list(_global_shape(param)))
        for name, param in model.named_parameters()
        if param.requires_grad
    )
    trainable_hash = hashlib.sha256(json.dumps(trainable).encode()).hexdigest()[:16]
    return {
        "base_model_config": base_hash,
        "lora": None if lora is None else lora.fingerprint(lora_target_names(model)),
        "trainable_parameters": trainable_hash,
    }


def fingerprint_mismatch(checkpoint: CommittedCheckpoint, ours: Mapping[str, Any]) -> str | None:
    """None when ``checkpoint`` was made for the model ``ours`` describes; else what differs.

    Returns:
        ``"<path> was made with another <key>: checkpoint has ..., this run has ..."``.
    """
    saved = checkpoint.manifest.get("fingerprint", {})
    for key, value in ours.items():
        theirs = saved.get(key)
        if theirs != value:
            if isinstance(theirs, dict) and isinstance(value, dict):
                # Only what differs: "checkpoint has {'rank': 8}, this run has {'rank': 4}".
                differ = [k for k in {**theirs, **value} if theirs.get(k) != value.get(k)]
                theirs = {k: theirs[k] for k in differ if k in theirs}
                value = {k: value[k] for k in differ if k in value}
            return (
                f"{checkpoint.path} was made with another {key.replace('_', ' ')}: "
                f"checkpoint has {theirs!r}, this run has {value!r}"
            )
    return None


def _streamed_files(reader: SafeReader, files: Mapping[str, Any]) -> set[str]:
    """The files of a step checkpoint its load verifies as it reads them (raw tensor files).

    Empty for a checkpoint of the ``torch.save`` format or one whose metadata cannot be read
    (its verification then fails on the metadata itself, before anything is loaded).
    """
    try:
        data_files = reader.data_files()
    except CheckpointError:
        return set()
    return data_files & set(files) if reader.raw_records else set()


def _global_shape(param: torch.Tensor) -> torch.Size:
    return param.shape if not isinstance(param, DTensor) else param.size()
