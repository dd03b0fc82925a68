"""The set-up and bookkeeping every training recipe shares, each default once.

Data loaders, optimizer and schedule, the checkpoint client, resume, when to validate /
export / save, and metric loggers. The training step itself is written out in each recipe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import tunelab.peft as peft
from tunelab.checkpoint.layout import check_resume_setting
from tunelab.config import instantiate
from tunelab.config.recipe_args import FinetuneArgs
from tunelab.data import StatefulDistributedSampler
from tunelab.data.preference import IndexedPairs
from tunelab.errors import CheckpointError, DataError
from tunelab.lifecycle import restart_of_job
from tunelab.training.setup import build_dataloader, config_fingerprint

if TYPE_CHECKING:
    from tunelab.checkpoint import CheckpointClient


@dataclass
class TrainingData:
    """A recipe's loaders and the sampler whose position checkpoints save."""

    loader: DataLoader
    """This rank's training micro-batches."""
    sampler: StatefulDistributedSampler
    """The resumable sampler behind ``loader``."""
    val_loader: DataLoader | None
    """Validation micro-batches, or None without ``val_dataset``."""
    steps_per_epoch: int
    """Optimizer steps per epoch (``max_steps_per_epoch`` applied)."""

    def step_in_epoch(self, args: FinetuneArgs) -> int:
        """Optimizer steps already taken in the sampler's epoch (non-zero after a resume)."""
        per_step = args.batch_size * args.gradient_accumulation_steps
        return self.sampler.consumed // self.sampler.samples_per_step(per_step)


def build_data(
    args: FinetuneArgs, tokenizer: Any, collate_fn: Callable, *, index_pairs: bool = False
) -> TrainingData:
    """Build the training (and validation) datasets and loaders from a recipe's config.

    Args:
        args: The recipe settings (``dataset``, ``val_dataset``, ``batch_size``, ...).
        tokenizer: Passed to the dataset components.
        collate_fn: Batches samples (``padded_collate_sft`` or ``padded_collate_dpo``).
        index_pairs: Give the training items of a preference dataset their dataset index
            (``IndexedPairs``), so that ``padded_collate_dpo`` batches carry ``pair_index``.

    Returns:
        The loaders, the sampler and the number of optimizer steps per epoch.
    """
    common = {"batch_size": args.batch_size, "collate_fn": collate_fn, "seed": args.seed}
    dataset = instantiate(args.dataset, tokenizer=tokenizer)
    if index_pairs:
        dataset = IndexedPairs(dataset)
    loader, sampler = build_dataloader(dataset, **common, pad_id=tokenizer.pad_id)
    val_loader = None
    if args.val_dataset is not None:
        val_dataset = instantiate(args.val_dataset, tokenizer=tokenizer)
        val_loader, _ = build_dataloader(
            val_dataset, **common, shuffle=False, pad_id=tokenizer.pad_id
        )
    steps_per_epoch = len(loader) // args.gradient_accumulation_steps
    if args.max_steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, args.max_steps_per_epoch)
    if steps_per_epoch == 0:
        # A run of zero steps would "finish" with nothing trained and nothing exported.
        per_step = args.batch_size * args.gradient_accumulation_steps * sampler.num_replicas
        raise DataError(
            f"dataset: {len(dataset)} samples, but one optimizer step takes {per_step} "
            f"(batch_size {args.batch_size} x gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} x {sampler.num_replicas} processes): "
            "no step can run; use more data or a smaller batch"
        )
    return TrainingData(loader, sampler, val_loader, steps_per_epoch)


def build_optimizer(
    args: FinetuneArgs, params: Iterable[torch.Tensor], num_training_steps: int
) -> tuple[torch.optim.Optimizer, Any]:
    """Instantiate the optimizer over ``params`` and its LR schedule (None if not configured)."""
    optimizer = instantiate(args.optimizer, params=params)
    lr_scheduler = None
    if args.lr_scheduler is not None:
        lr_scheduler = instantiate(
            args.lr_scheduler, optimizer=optimizer, num_training_steps=num_training_steps
        )
    return optimizer, lr_scheduler


def build_checkpoint_client(
    args: FinetuneArgs,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    tokenizer: Any = None,
) -> CheckpointClient:
    """The run's ``CheckpointClient`` (call after ``init_distributed``).

    A recipe whose settings have ``lora`` gets adapter-only checkpoints and LoRA exports. With
    ``tokenizer``, exports also carry what it adds to the base model's files (an overridden
    chat template), so the exported model is served with the template it was trained on.
    """
    # Imported here: tunelab.checkpoint imports tunelab.training (RNG state) as it loads.
    from tunelab.checkpoint import CheckpointClient, LoRASpec

    lora = getattr(args, "lora", None)
    spec = None
    if lora is not None:
        spec = LoRASpec(
            rank=lora.rank,
            alpha=lora.alpha,
            targets=tuple(peft.lora_target_names(model)),
            use_rslora=lora.use_rslora,
            dropout=lora.dropout,
            use_dora=lora.use_dora,
            quantize_base=lora.quantize_base,
        )
    return CheckpointClient(
        args.output_dir,
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        base_checkpoint_dir=args.checkpoint_dir,
        lora=spec,
        enable_async=args.checkpoint.enable_async_checkpointing,
        keep_last_n=args.checkpoint.keep_last_n_checkpoints,
        config_hash=config_fingerprint(args),
        export_files=tokenizer.extra_files() if hasattr(tokenizer, "extra_files") else None,
    )


def resume(
    args: FinetuneArgs, checkpoints: CheckpointClient, data: TrainingData
) -> tuple[int, int]:
    """Restore the newest committed checkpoint as ``checkpoint.resume_from_checkpoint`` says.

    ``true`` resumes and fails when there is nothing to resume; ``"auto"`` resumes when
    ``output_dir`` holds a committed checkpoint and starts fresh otherwise (what a
    scheduler's restart loop needs); ``false`` starts fresh. Rank 0 prints what was done.

    Returns:
        ``(global_step, start_epoch)``: ``(0, 0)`` for a fresh run.

    Raises:
        CheckpointError: A fresh run's ``output_dir`` already holds committed checkpoints
            (said at start, not at the first save that would collide with one), or
            ``resume_from_checkpoint: true`` finds nothing to resume.
    """
    mode = args.checkpoint.resume_from_checkpoint
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    # A torchrun restart (--max-restarts) says so: "restart 1 of 2: resumed from step_4 ...".
    restart, max_restarts = restart_of_job()
    said = f"restart {restart} of {max_restarts}: " if restart else ""
    _check_resume_setting_once(args.output_dir, mode)
    if mode is False:
        return 0, 0
    resumed = checkpoints.load_latest()
    if resumed is None:
        if is_main:
            print(f"{said}no checkpoint in {args.output_dir}: starting fresh", flush=True)
        return 0, 0
    data.sampler.load_state_dict(resumed.progress["sampler"])
    start_epoch = resumed.epoch + 1 if resumed.progress["epoch_done"] else resumed.epoch
    if is_main:
        step_in_epoch = 0 if resumed.progress["epoch_done"] else data.step_in_epoch(args)
        print(
            f"{said}resumed from {resumed.path.name} (epoch {start_epoch}, step {step_in_epoch} "
            f"of {data.steps_per_epoch})",
            flush=True,
        )
    return resumed.step, start_epoch


def _check_resume_setting_once(output_dir: str, mode: bool | str) -> None:
    """``check_resume_setting`` on rank 0, its verdict raised on every rank.

    One view of the folder: on a network filesystem another node's listing may lag rank 0's,
    and a rank raising alone would leave the others waiting in their next collective.
    """
    problem: list[str | None] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            check_resume_setting(output_dir, mode)
        except CheckpointError as error:
            problem = [str(error)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0])


def progress_record(data: TrainingData, epoch_done: bool) -> dict[str, Any]:
    """What a step checkpoint records of the recipe's progress."""
    return {"sampler": data.sampler.state_dict(), "epoch_done": epoch_done}


@dataclass(frozen=True)
class Schedule:
    """When to validate, export and save, from a recipe's settings."""

    args: FinetuneArgs

    def validate(self, global_step: int, epoch_done: bool) -> bool:
        """Every ``run_val_every_n_steps`` and at each epoch end."""
        return epoch_done or _every(global_step, self.args.run_val_every_n_steps)

    def export(self, epoch: int, epoch_done: bool) -> bool:
        """At epoch ends, every ``export_every_n_epochs`` and always the last."""
        return epoch_done and (
            self.is_last(epoch, epoch_done)
            or _every(epoch + 1, self.args.checkpoint.export_every_n_epochs)
        )

    def save(self, global_step: int, epoch_done: bool) -> bool:
        """Every ``save_every_n_steps`` and at each epoch end."""
        return epoch_done or _every(global_step, self.args.checkpoint.save_every_n_steps)

    def log(self, global_step: int) -> bool:
        """Every ``log_every_n_steps``."""
        return _every(global_step, self.args.log_every_n_steps)

    def is_last(self, epoch: int, epoch_done: bool) -> bool:
        """Whether this step ends the run (its save has nothing left to overlap with)."""
        return epoch_done and epoch == self.args.epochs - 1


class MetricLoggers:
    """The configured metric loggers on rank 0; nothing on other ranks.

    Args:
        nodes: The ``metric_loggers`` component nodes.
        enabled: Whether this rank logs (rank 0).
    """

    def __init__(self, nodes: list, *, enabled: bool) -> None:
        self._loggers = [instantiate(node) for node in nodes] if enabled else []

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Send ``metrics`` of ``step`` to every logger."""
        for logger in self._loggers:
            logger.log(metrics, step)

    def start_at(self, step: int) -> None:
        """Forget records after ``step`` (those a resumed run is about to log again)."""
        for logger in self._loggers:
            if hasattr(logger, "truncate_after"):
                logger.truncate_after(step)

    def close(self) -> None:
        """Flush and close every logger."""
        for logger in self._loggers:
            logger.close()


def _every(count: int, interval: int | None) -> bool:
    return bool(interval) and count % interval == 0
