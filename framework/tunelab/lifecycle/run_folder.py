"""``RunFolder``: the one owner of a run's ``output_dir``.

Every path inside ``output_dir`` is named here, and nowhere else::

    step_{N}/              resumable DCP checkpoint, committed by its manifest
    epoch_{E}/             Hugging Face export (``adapter/`` inside it for LoRA)
    step_{N}_export/       the same made from step_{N}/ by ``tunelab export`` (never by a run)
    logs/                  per-step logs (STEP_LOGS), each rank's traceback log (rank_{R}.log)
    profile/               torch.profiler traces (rank_{R}.json)
    .tunelab.lock          held by the run's rank 0 for its whole life
    .tunelab_run           marks a folder tunelab made (what clean-up may touch)
    .{name}.tunelab-*      temporaries while something is written (``layout.temporary_name``)

It also owns what a run does with the folder as a whole, in the order a run needs it
(:meth:`RunFolder.start`): take the lock first (a second run stops there, whatever the folder
holds), then check the resume setting against the committed checkpoints, then remove what a
killed run left. Discovery of committed checkpoints and retention are here too, and so is the
trim of every per-step log when a run starts from a checkpoint (:meth:`RunFolder.trim_step_logs`).

Trust: tunelab never follows a link inside ``output_dir``. A ``step_N`` or ``epoch_E`` entry
that is a link is not a checkpoint or an export (it is never resumed, pruned or written
through), the lock is opened with ``O_NOFOLLOW``, and clean-up deletes only entries it can
tell it wrote: temporaries of its naming, and step folders that hold nothing but checkpoint
files. Anything else is left in place and named in one warning.

Nothing here imports torch at module level: ``tunelab run`` and ``tunelab validate`` check
a folder before any process starts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.errors import CheckpointError
from tunelab.formats import layout
from tunelab.formats.integrity import MANIFEST_NAME
from tunelab.lifecycle.output_lock import LOCK_FILE_NAME, check_output_dir_free, lock_output_dir

logger = logging.getLogger(__name__)

MARKER_NAME = ".tunelab_run"
"""Written when tunelab creates or first takes a folder: its leftovers there are its own."""
LOGS_DIR_NAME = "logs"
PROFILE_DIR_NAME = "profile"
STEP_LOGS: tuple[str, ...] = (
    "metrics.jsonl",  # JsonlLogger's default: every metric, validation and eval score
    "completions.jsonl",  # grpo_distributed: every completion with its rewards
)
"""Every per-step log in ``logs/``: JSON Lines, one object per line with its ``step``.

A run that starts from a checkpoint trims each to that step (:meth:`RunFolder.trim_step_logs`)
before it logs the later steps again, so every step is in each file once. A new per-step log
is one name here, written at :meth:`RunFolder.step_log`.
"""
_STEP_PATTERN = re.compile(r"^step_(\d+)$")
_EPOCH_PATTERN = re.compile(r"^epoch_(\d+)$")
_STEP_EXPORT_PATTERN = re.compile(r"^step_(\d+)_export$")
# What a step folder holds when tunelab wrote it: DCP's files, the trainer state, the manifest
# and temporaries. A step folder with anything else in it is not removed as a leftover.
_CHECKPOINT_FILE = re.compile(
    r"^(__\d+_\d+\.distcp|\.metadata|\.metadata\.json|trainer_state\.json|"
    + re.escape(MANIFEST_NAME)
    + r")$"
)


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed step directory and its manifest."""

    step: int
    path: Path
    manifest: dict[str, Any]


@dataclass(frozen=True)
class UnreadableCheckpoint:
    """A step directory with a manifest that cannot be read."""

    step: int
    path: Path
    reason: str


class RunFolder:
    """A run's ``output_dir``: its paths, its lock, its checkpoints and its clean-up.

    Args:
        root: The ``output_dir`` setting.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.root)!r})"

    def __str__(self) -> str:
        return str(self.root)

    # -- names -------------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        """``step_{step}/``: the resumable checkpoint taken after optimizer step ``step``."""
        return self.root / f"step_{step}"

    def epoch_dir(self, epoch: int) -> Path:
        """``epoch_{epoch}/``: the Hugging Face export of an epoch."""
        return self.root / f"epoch_{epoch}"

    def step_export_dir(self, step: int) -> Path:
        """``step_{step}_export/``: the export ``tunelab export`` makes from ``step_{step}/``."""
        return self.root / f"step_{step}_export"

    @property
    def logs_dir(self) -> Path:
        """``logs/``: metrics files and the ranks' traceback logs."""
        return self.root / LOGS_DIR_NAME

    def step_log(self, name: str) -> Path:
        """``logs/{name}``: a per-step log, one of :data:`STEP_LOGS` (trimmed at a resume).

        Raises:
            ValueError: ``name`` is not in :data:`STEP_LOGS`: a resume would not trim it.
        """
        if name not in STEP_LOGS:
            raise ValueError(f"{name!r} is not a per-step log of tunelab.lifecycle.STEP_LOGS")
        return self.logs_dir / name

    def trim_step_logs(self, step: int) -> dict[str, int]:
        """Drop the records past ``step`` from every per-step log (:data:`STEP_LOGS`).

        Called by the rank that writes the logs (rank 0) when a run starts, before it logs:
        a run resumed from ``step_{step}`` logs the steps after it again, and a fresh run
        (``step`` 0) starts its logs empty. Lines a kill cut short are dropped too.

        Args:
            step: The step the run starts from (its checkpoint's; 0 for a fresh run).

        Returns:
            The number of lines dropped, by log name (only logs that lost lines).

        Raises:
            CheckpointError: A log cannot be read or rewritten.
        """
        dropped = {}
        for name in STEP_LOGS:
            path = self.logs_dir / name
            if path.is_symlink():
                logger.warning("not trimming %s: a link, which tunelab never follows", path)
                continue
            try:
                count = trim_step_records(path, step)
            except OSError as error:
                raise CheckpointError(f"cannot trim {path} to step {step}: {error}") from error
            if count:
                dropped[name] = count
        return dropped

    def rank_log(self, rank: int | str) -> Path:
        """``logs/rank_{rank}.log``: where a rank's traceback goes when it fails."""
        return self.logs_dir / f"rank_{rank}.log"

    @property
    def profile_dir(self) -> Path:
        """``profile/``: the profiler's traces."""
        return self.root / PROFILE_DIR_NAME

    @property
    def lock_file(self) -> Path:
        """``.tunelab.lock``."""
        return self.root / LOCK_FILE_NAME

    # -- start-up ----------------------------------------------------------------------

    def check_before_start(self, resume: bool | str | None, *, may_exist: bool = True) -> None:
        """What :meth:`start` would refuse, said before any process starts (no torch, no lock).

        The lock first: a folder another run holds is "in use", whatever it contains.

        Raises:
            CheckpointError: Another run holds the folder, or the resume setting cannot do
                what it says here (see :meth:`check_resume_setting`), or the folder is not
                tunelab's (see :meth:`check_owned`).
        """
        check_output_dir_free(self.root)
        self.check_no_links()
        self.check_owned(may_exist=may_exist)
        if resume is not None:
            self.check_resume_setting(resume)

    def start(self, resume: bool | str, *, may_exist: bool = True) -> None:
        """Take the folder for this run: lock, check, clean up. Every rank calls it.

        Call it right after ``init_distributed()``, before loading anything. Rank 0 takes the
        lock (a second run stops here, naming the holder), then checks the resume setting
        and the folder's ownership, marks the folder as tunelab's and removes what a killed
        run left; every rank raises the same error.

        Args:
            resume: ``checkpoint.resume_from_checkpoint``: ``True``, ``False`` or ``"auto"``.
            may_exist: ``output_dir_may_exist``: a first run may write into a non-empty
                folder tunelab did not make.

        Raises:
            CheckpointError: On every rank, as :meth:`check_before_start` says.
        """
        lock_output_dir(self.root)
        _on_rank0_raise_everywhere(lambda: self._start_on_rank0(resume, may_exist))

    def _start_on_rank0(self, resume: bool | str, may_exist: bool) -> None:
        self.check_no_links()
        self.check_owned(may_exist=may_exist)
        self.check_resume_setting(resume)
        self._mark()
        try:
            for path in self.remove_leftovers():
                logger.info("removed %s, left by an interrupted run", path)
        except OSError as error:
            raise CheckpointError(f"cannot clean up {self.root}: {error}") from error

    def check_no_links(self) -> None:
        """Refuse a folder whose checkpoint or export names are links (said before training).

        A run would write (a save, an export) through such a link into whatever it points at.

        Raises:
            CheckpointError: Naming the first link and its target.
        """
        if not self.root.is_dir():
            return
        for path in sorted(self.root.iterdir()):
            named = _STEP_PATTERN.match(path.name) or _EPOCH_PATTERN.match(path.name)
            if named and path.is_symlink():
                raise CheckpointError(
                    f"{path} is a link (to {os.readlink(path)}); tunelab never writes through "
                    "links in an output_dir: remove it, or pick another output_dir"
                )

    def check_owned(self, *, may_exist: bool) -> None:
        """Refuse a non-empty folder that tunelab did not make, unless ``may_exist``.

        Raises:
            CheckpointError: ``output_dir`` holds entries and no tunelab marker.
        """
        if may_exist or not self.root.is_dir() or self._made_by_tunelab():
            return
        # What a run writes before it takes the folder: the lock, a failed start's logs.
        ours = (LOCK_FILE_NAME, MARKER_NAME, LOGS_DIR_NAME)
        foreign = sorted(e.name for e in self.root.iterdir() if e.name not in ours)
        if foreign:
            raise CheckpointError(
                f"output_dir {self.root} is not empty ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}) and was not made by tunelab: pick "
                "another output_dir, or set output_dir_may_exist=true"
            )

    def _made_by_tunelab(self) -> bool:
        """The marker, or (a folder of an older tunelab) a committed manifest in it."""
        if (self.root / MARKER_NAME).is_file():
            return True
        entries = self._entries(_STEP_PATTERN) + self._entries(_EPOCH_PATTERN)
        return any((path / MANIFEST_NAME).is_file() for _, path in entries)

    def _mark(self) -> None:
        marker = self.root / MARKER_NAME
        if marker.is_symlink() or marker.is_file():
            return
        layout.write_atomic(marker, json.dumps({"made_by": "tunelab"}).encode() + b"\n")

    def check_resume_setting(self, resume: bool | str) -> None:
        """Refuse a ``resume_from_checkpoint`` that cannot do what it says here.

        Reads manifests only (no torch).

        Args:
            resume: ``True``, ``False`` or ``"auto"``.

        Raises:
            CheckpointError: ``False`` (a fresh run) into a folder with committed checkpoints,
                whose first save would collide with one; ``True`` into a folder with none.
        """
        committed, unreadable = self.scan_checkpoints()
        existing = sorted((c.step, c.path.name) for c in [*committed, *unreadable])
        if resume is False and existing:
            names = ", ".join(name for _, name in existing[-3:])
            raise CheckpointError(
                f"output_dir {self.root} already holds committed checkpoints ({names}): "
                "continue with checkpoint.resume_from_checkpoint=true (or auto), or pick "
                "another output_dir"
            )
        if resume is True and not existing:
            raise CheckpointError(
                f"checkpoint.resume_from_checkpoint=true but {self.root} holds no committed "
                "checkpoint: set it to auto to start fresh when there is none"
            )

    # -- checkpoints -------------------------------------------------------------------

    def scan_checkpoints(self) -> tuple[list[CommittedCheckpoint], list[UnreadableCheckpoint]]:
        """The committed step directories and those whose manifest is unreadable, oldest first.

        Directories without a manifest (in flight, or left by a crash) are in neither, and
        so is a ``step_N`` that is a link (never followed; warned once).
        """
        committed: list[CommittedCheckpoint] = []
        unreadable: list[UnreadableCheckpoint] = []
        for step, path in self._entries(_STEP_PATTERN):
            try:
                manifest = layout.read_manifest(path)
            except CheckpointError as error:
                unreadable.append(UnreadableCheckpoint(step, path, str(error)))
                continue
            if manifest is not None:
                committed.append(CommittedCheckpoint(step, path, manifest))
        return (
            sorted(committed, key=lambda checkpoint: checkpoint.step),
            sorted(unreadable, key=lambda checkpoint: checkpoint.step),
        )

    def committed_checkpoints(self) -> list[CommittedCheckpoint]:
        """The committed step directories, oldest first (see :meth:`scan_checkpoints`)."""
        return self.scan_checkpoints()[0]

    def _entries(self, pattern: re.Pattern) -> list[tuple[int, Path]]:
        """``(number, path)`` of the real folders named like ``pattern``; links skipped."""
        found = []
        if not self.root.is_dir():
            return found
        for path in self.root.iterdir():
            match = pattern.match(path.name)
            if not match:
                continue
            if path.is_symlink():
                logger.warning("ignoring %s: a link, which tunelab never follows", path)
                continue
            if path.is_dir():
                found.append((int(match.group(1)), path))
        return found

    def prune(self, keep_last_n: int) -> list[Path]:
        """Delete committed step directories older than the newest ``keep_last_n``.

        Only committed real folders are candidates (never a link, never the one in flight,
        never the newest). The manifest goes first, so a crash mid-delete leaves an
        uncommitted folder, never a committed one with missing files.

        Returns:
            The deleted directories.
        """
        if keep_last_n < 1:
            raise ValueError("keep_last_n must be at least 1")
        deleted = []
        for checkpoint in self.committed_checkpoints()[:-keep_last_n]:
            (checkpoint.path / MANIFEST_NAME).unlink()
            _remove_tree(checkpoint.path)
            deleted.append(checkpoint.path)
        return deleted

    # -- clean-up ----------------------------------------------------------------------

    def remove_leftovers(self) -> list[Path]:
        """Delete what a killed run left: only what tunelab can tell it wrote.

        That is temporaries of tunelab's naming (``layout.is_temporary_name``) in the folder
        and in its step, epoch, adapter and ``logs/`` folders, and uncommitted step folders that hold
        nothing but checkpoint files. Links are never followed or deleted; an uncommitted
        step folder holding other files is left in place and named in one warning.

        Call only from the process that holds the lock, before it writes.

        Returns:
            The deleted paths.
        """
        if not self.root.is_dir() or self.root.is_symlink():
            return []
        deleted: list[Path] = []
        kept: list[str] = []
        for path in sorted(self.root.iterdir()):
            parsed = layout.parse_temporary_name(path.name)
            if path.is_symlink() or parsed is None:
                continue
            final, kind = parsed
            if kind == "old" and path.is_dir():
                if not (self.root / final).exists() and not (self.root / final).is_symlink():
                    # A crash between an export's two renames: the old export goes back.
                    os.replace(path, self.root / final)
                    logger.info("restored %s, which an interrupted export had moved aside", final)
                elif layout.retire_folder(path, final) is None:
                    deleted.append(path)
                continue
            _remove_tree(path)
            deleted.append(path)
        steps = self._entries(_STEP_PATTERN)
        exports = self._entries(_EPOCH_PATTERN) + self._entries(_STEP_EXPORT_PATTERN)
        folders = [path for _, path in steps] + [path for _, path in exports]
        adapters = [folder / "adapter" for folder in folders]
        folders += [a for a in adapters if a.is_dir() and not a.is_symlink()]
        # A kill during a resume's log trim leaves its temporary beside the log.
        if self.logs_dir.is_dir() and not self.logs_dir.is_symlink():
            folders.append(self.logs_dir)
        for folder in folders:
            for path in sorted(folder.iterdir()):
                if not path.is_symlink() and layout.is_temporary_name(path.name):
                    _remove_tree(path)
                    deleted.append(path)
        for _, path in steps:
            if (path / MANIFEST_NAME).exists() or (path / MANIFEST_NAME).is_symlink():
                continue
            foreign = [
                entry.name
                for entry in path.iterdir()
                if entry.is_symlink()
                or not entry.is_file()
                or not _CHECKPOINT_FILE.match(entry.name)
            ]
            if foreign:
                kept.append(f"{path.name} ({', '.join(sorted(foreign)[:2])})")
                continue
            _remove_tree(path)
            deleted.append(path)
        if kept:
            logger.warning(
                "left in place in %s, not written by tunelab: %s", self.root, "; ".join(kept)
            )
        return deleted


def trim_step_records(file: Path, last_step: int) -> int:
    """Drop the records of a per-step JSON Lines log past ``last_step``, in place.

    A run resumed from the checkpoint of step ``last_step`` logs the later steps again; without
    this they would be in the file twice. Kept: every record whose ``step`` is at most
    ``last_step`` (and a record without one). Dropped: records of later steps and lines that
    are not JSON objects (a line cut short by a kill). The file is rewritten only when something
    is dropped, through a temporary file renamed over it, so a kill during the trim leaves the
    old file or the trimmed one; lines are streamed, never held whole (a GRPO run's
    ``completions.jsonl`` can be large).

    Args:
        file: The log; nothing is done if it does not exist.
        last_step: The step of the checkpoint the run resumes from (0: a fresh run).

    Returns:
        The number of lines dropped.
    """
    if not file.is_file():
        return 0
    with file.open("rb") as stream:
        dropped = sum(1 for raw in stream if raw.strip() and not _kept(raw, last_step))
    if not dropped:
        return 0
    temp = file.with_name(layout.temporary_name(file.name, "tmp", os.getpid()))
    try:
        with file.open("rb") as stream, temp.open("wb") as out:
            for raw in stream:
                if raw.strip() and _kept(raw, last_step):
                    out.write(raw if raw.endswith(b"\n") else raw + b"\n")
        os.replace(temp, file)
    finally:
        temp.unlink(missing_ok=True)
    return dropped


def _kept(raw: bytes, last_step: int) -> bool:
    """Whether a log line is a JSON object of step ``last_step`` or earlier (or of no step)."""
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    step = record.get("step", 0) if isinstance(record, dict) else None
    return isinstance(step, int) and step <= last_step


def _remove_tree(path: Path) -> None:
    """Delete ``path`` itself: a link is unlinked, never followed."""
    mode = os.lstat(path).st_mode
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        path.unlink()


def _on_rank0_raise_everywhere(check: Any) -> None:
    """Run ``check`` on rank 0; its ``CheckpointError`` is raised on every rank.

    One view of the folder: on a network filesystem another node's listing may lag rank 0's,
    and a rank raising alone would leave the others waiting in their next collective.
    """
    import torch.distributed as dist  # Here: `tunelab run` imports this module without torch.

    problem: list[str | None] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            check()
        except CheckpointError as error:
            problem = [str(error)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0])
