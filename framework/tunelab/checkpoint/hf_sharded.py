"""Hugging Face model folders from (sharded) state: the writer, config files, a safe swap.

``save_hf_sharded`` runs one ``dcp.save`` with ``HFSafetensorsWriter`` on every rank into a
temporary sibling folder, copies config and tokenizer files, and swaps the folder into place
on rank 0, so a crash never leaves a partial export over a good one.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from tunelab._fs import exchange_paths, fsync_path
from tunelab.checkpoint.consolidate import DEFAULT_MAX_SHARD_SIZE, HFSafetensorsWriter, temp_name
from tunelab.checkpoint.dcp import as_checkpoint_error
from tunelab.checkpoint.hf_write import copy_model_files
from tunelab.errors import CheckpointError, TunelabError
from tunelab.formats.layout import retire_folder, temporary_name, write_manifest

__all__ = ["save_hf_sharded"]


def save_hf_sharded(
    state_dict: dict[str, torch.Tensor],
    output_dir: str | os.PathLike,
    *,
    fqn_to_file: Mapping[str, str] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    process_group: dist.ProcessGroup | None = None,
    source_dir: str | os.PathLike | None = None,
    torch_dtype: torch.dtype | None = None,
    sync_files: bool = True,
    thread_count: int = 1,
    local_transforms: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    first: Callable[[Path], None] | None = None,
) -> Path:
    """Export a (possibly sharded) HF-keyed state dict as a Hugging Face model folder.

    All ranks of ``process_group`` call this. The files are written into a sibling temporary
    folder (``.{name}.tunelab-partial``) which rank 0 swaps with ``output_dir`` at the end, in
    one atomic step where the system can, so a crash leaves the old export or the new one,
    whole, never a mix. An existing ``output_dir`` is replaced as a whole: the new one holds
    everything it needs (``first`` writes a LoRA adapter into it).

    Args:
        state_dict: HF key to tensor or ``DTensor``.
        output_dir: Final model folder.
        fqn_to_file: Key to file name (see ``HFSafetensorsWriter``).
        max_shard_size: Greedy file size limit when ``fqn_to_file`` is None.
        process_group: Group for the collective save; None uses the default group, or a
            single-process save when no group is initialised.
        source_dir: Base model folder whose config, generation config and tokenizer files
            are copied next to the weights; None copies nothing.
        torch_dtype: dtype recorded in the copied ``config.json``.
        sync_files: fsync files before they are renamed into place.
        thread_count: Writer threads per rank.
        local_transforms: Key to a function applied to this rank's chunk of that key just
            before it is written; it must return a tensor of the chunk's shape and the
            state dict value's dtype. Values computed this way (e.g. a deferred LoRA merge,
            ``tunelab.peft.merge.lazy_merged_state_dict``) exist one at a time, and one
            rank's compute overlaps the others' writes.
        extra_files: Files rank 0 writes beside the copied model files, by name
            (``copy_model_files``), e.g. an overridden ``chat_template.jinja``.
        first: Rank 0 calls it with the new folder before any weight is written (a LoRA
            export writes its small adapter there first); what it writes is part of the export.

    Returns:
        The output folder.

    Raises:
        CheckpointError: If the state cannot be exported (see ``HFSafetensorsWriter``).
    """
    final = Path(output_dir)
    staging = final.parent / temp_name(final.name)
    distributed = dist.is_available() and dist.is_initialized()
    is_rank_zero = not distributed or dist.get_rank(process_group) == 0
    if is_rank_zero:
        # No rank writes before the plan step, in which rank 0 takes part after this.
        shutil.rmtree(staging, ignore_errors=True)
        if first is not None:
            staging.mkdir(parents=True)
            first(staging)
    writer = HFSafetensorsWriter(
        staging,
        fqn_to_file=fqn_to_file,
        max_shard_size=max_shard_size,
        sync_files=sync_files,
        thread_count=thread_count,
    )
    try:
        with warnings.catch_warnings():
            # One process without a group is a supported case here, not a slip to warn about.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                state_dict,
                storage_writer=writer,
                planner=_TransformingPlanner(local_transforms or {}),
                process_group=process_group,
                no_dist=not distributed,
            )
    except CheckpointException as error:
        # DCP fails on every rank once all of them are past their writes.
        if is_rank_zero:
            shutil.rmtree(staging, ignore_errors=True)
        raise as_checkpoint_error(error, final, "exporting") from error
    failure = None
    if is_rank_zero:
        try:
            files = dict(writer.file_records)
            if source_dir is not None:
                files.update(copy_model_files(source_dir, staging, torch_dtype, extra_files))
            write_manifest(staging, files, kind="export")
        except (OSError, TunelabError) as error:
            failure = as_checkpoint_error(error, final, "exporting")
            # Every rank has written its part by now: a failed export leaves nothing behind.
            shutil.rmtree(staging, ignore_errors=True)
        else:
            try:
                _swap_into_place(staging, final, sync_files)
            except OSError as error:
                # Kept: the staging folder may hold entries moved out of the old export.
                failure = as_checkpoint_error(error, final, "exporting")
    if distributed:
        # Instead of a barrier: the other ranks learn whether rank 0 finished, and never hang.
        message = [None if failure is None else str(failure)]
        dist.broadcast_object_list(message, group=process_group, group_src=0)
        if failure is None and message[0] is not None:
            raise CheckpointError(f"rank 0 could not finish the export to {final}: {message[0]}")
    if failure is not None:
        raise failure
    return final


class _TransformingPlanner(DefaultSavePlanner):
    """DCP's default save planner, which maps some keys' chunks through a function."""

    def __init__(self, transforms: Mapping[str, Callable[[torch.Tensor], torch.Tensor]]) -> None:
        super().__init__()
        self._transforms = transforms

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        """The chunk to write, transformed if its key has a transform."""
        data = super().resolve_data(write_item)
        transform = self._transforms.get(write_item.index.fqn)
        return data if transform is None else transform(data)


def _swap_into_place(staging: Path, final: Path, sync_files: bool) -> None:
    """Replace ``final`` by ``staging`` as a whole, in one atomic step where the system can.

    The new export holds everything it needs (a LoRA export's adapter included), so nothing
    moves over from the old one. The old folder is then retired (``layout.retire_folder``):
    deleted when it holds only what tunelab wrote, else kept aside under a new name.
    """
    if final.is_symlink():
        # Its entries would be replaced inside whatever it points at.
        raise CheckpointError(
            f"{final} is a link; tunelab never writes through links in an output_dir: remove it"
        )
    if not final.exists():
        os.replace(staging, final)
    elif exchange_paths(staging, final):
        retire_folder(staging, final.name)  # The exchange left the old export at `staging`.
    else:
        # Two renames: a crash between them leaves the old export under its temporary name,
        # which the run folder's clean-up puts back (RunFolder.remove_leftovers).
        previous = final.parent / temporary_name(final.name, "old")
        os.replace(final, previous)
        os.replace(staging, final)
        retire_folder(previous, final.name)
    if sync_files:
        fsync_path(final.parent)
