"""The set-up and bookkeeping every training recipe shares, each taking only what it uses.

Data loaders, optimizer and schedule, the checkpoint client, resume, and :class:`AfterStep`:
what a recipe does after each optimizer step (progress, metrics, validation, export, save,
a stop signal). The training step itself is written out in each recipe. No building block here
takes a recipe's whole settings object: they take the records they use (``CheckpointArgs``,
``LoRAArgs``, a ``RunFolder``) and plain values, so a copied recipe with its own settings
dataclass calls them unchanged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from tunelab.config import instantiate
from tunelab.config.lora import LoRAArgs
from tunelab.config.recipe_args import CheckpointArgs
from tunelab.config.sections import ScheduleArgs
from tunelab.data import StatefulDistributedSampler
from tunelab.data.preference import IndexedPairs
from tunelab.data.stream_loader import StreamLoader, StreamPosition
from tunelab.data.streaming import StreamingDataset
from tunelab.distributed.tensor_parallel import tensor_parallel_size
from tunelab.errors import ConfigError, DataError
from tunelab.lifecycle import Preemption, RunFolder, restart_of_job
from tunelab.training.loop import peak_memory_gib
from tunelab.training.profiler import StepProfiler
from tunelab.training.progress import ProgressBar
from tunelab.training.setup import build_dataloader, build_stream_loader

if TYPE_CHECKING:
    from tunelab.checkpoint import CheckpointClient

logger = logging.getLogger(__name__)


@dataclass
class TrainingData:
    """A recipe's loaders, the sampler whose position checkpoints save, and the step size."""

    loader: DataLoader | StreamLoader
    """This rank's training micro-batches."""
    sampler: StatefulDistributedSampler | StreamPosition
    """The resumable sampler behind ``loader`` (a stream's position with ``streaming``)."""
    val_loader: DataLoader | None
    """Validation micro-batches, or None without a validation dataset."""
    steps_per_epoch: int
    """Optimizer steps per epoch (``max_steps_per_epoch`` applied)."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step (resume may have chosen it: ``keep_global_batch``)."""
    samples_per_step: int
    """This rank's samples per optimizer step: ``batch_size * gradient_accumulation_steps``."""
    progress_extras: dict[str, Callable[[], Any]] = field(default_factory=dict)
    """Recipe state each step checkpoint records beside the position: name -> a call (every rank makes it) returning JSON data whose numbers are non-negative."""
    resumed_progress: dict[str, Any] | None = None
    """The progress record ``resume`` restored (the recipe reads its own entries from it), or None."""

    def step_in_epoch(self) -> int:
        """Optimizer steps already taken in the sampler's epoch (non-zero after a resume)."""
        return self.sampler.consumed // self.sampler.samples_per_step(self.samples_per_step)

    def epoch(self, epoch: int) -> Iterator[Any]:
        """This rank's micro-batches of ``epoch``, from the saved position on."""
        self.sampler.set_epoch(epoch)
        return iter(self.loader)

    def advance(self) -> None:
        """Count one optimizer step's samples as used (call after the step)."""
        self.sampler.advance(self.samples_per_step)

    def progress(self, epoch_done: bool) -> dict[str, Any]:
        """What a step checkpoint records of the recipe's progress."""
        return {
            "sampler": self.sampler.state_dict(),
            "epoch_done": epoch_done,
            # Samples per optimizer step over all ranks: a resume on another world size keeps it.
            "global_batch": self.sampler.samples_per_step(self.samples_per_step),
        } | {name: get() for name, get in self.progress_extras.items()}


@dataclass(frozen=True)
class Datasets:
    """What a recipe trains (and validates) on, and how its samples become batches.

    Args:
        dataset: The training dataset's component node (called with ``tokenizer``).
        tokenizer: Passed to the dataset components.
        collate_fn: Batches samples (``padded_collate_sft`` or ``padded_collate_dpo``).
        val_dataset: The validation dataset's component node, or None.
        index_pairs: Give the training items of a preference dataset their dataset index
            (``IndexedPairs``), so that ``padded_collate_dpo`` batches carry ``pair_index``.
    """

    dataset: Any
    tokenizer: Any
    collate_fn: Callable
    val_dataset: Any = None
    index_pairs: bool = False


def build_data(
    datasets: Datasets,
    schedule: ScheduleArgs,
    *,
    seed: int = 0,
    resume_from: RunFolder | None = None,
    ranks_per_sample: int = 1,
    model_context: int | None = None,
) -> TrainingData:
    """Build the training (and validation) datasets and loaders.

    Args:
        datasets: The datasets, their tokenizer and the collate function.
        schedule: The ``schedule`` settings: ``batch_size`` (samples per micro-batch per
            process), ``gradient_accumulation_steps``, ``max_steps_per_epoch``, and
            ``allow_global_batch_change`` (resume with the configured batch even when it
            changes the global batch: the run is then not the uninterrupted one), and
            ``dataloader_workers`` (processes collating the batches of a map-style dataset).
        seed: Seed of the per-epoch shuffle.
        resume_from: The run folder when the run may resume (``resume_from_checkpoint`` true
            or auto): the global batch its newest checkpoint recorded is kept on any number
            of processes (see :func:`keep_global_batch`).
        ranks_per_sample: Consecutive ranks that share each sample (context-parallel ranks
            split its sequence, tensor-parallel ones its matmuls), so the data-parallel ranks
            are the processes divided by it (``ParallelismArgs.ranks_per_sample``).
        model_context: The model's ``max_position_embeddings``: samples longer than it are
            counted and logged (:func:`report_past_context`); None: not checked.

    Returns:
        The loaders, the sampler and the number of optimizer steps per epoch.

    Raises:
        DataError: The dataset is too small for one optimizer step.
        ConfigError: A resume cannot keep the recorded global batch on this world size.
    """
    dataset, tokenizer, val_dataset = datasets.dataset, datasets.tokenizer, datasets.val_dataset
    batch_size = schedule.batch_size
    gradient_accumulation_steps = schedule.gradient_accumulation_steps
    max_steps_per_epoch = schedule.max_steps_per_epoch
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    data_parallel_size = world_size // ranks_per_sample
    if resume_from is not None and not schedule.allow_global_batch_change:
        batch_size, gradient_accumulation_steps = keep_global_batch(
            resume_from, batch_size, gradient_accumulation_steps, data_parallel_size
        )
    common = {
        "batch_size": batch_size,
        "collate_fn": datasets.collate_fn,
        "seed": seed,
        "ranks_per_sample": ranks_per_sample,
    }
    train = instantiate(dataset, tokenizer=tokenizer)
    log_data_counts("dataset", train)
    report_past_context(train, "dataset", model_context)
    if isinstance(train, StreamingDataset):
        return _stream_data(
            train, tokenizer, common, val_dataset, max_steps_per_epoch, datasets.index_pairs,
            gradient_accumulation_steps,
        )  # fmt: skip
    if datasets.index_pairs:
        train = IndexedPairs(train)
    workers = {"num_workers": schedule.dataloader_workers}
    loader, sampler = build_dataloader(train, **common, **workers, pad_id=tokenizer.pad_id)
    val_loader = None
    if val_dataset is not None:
        validation = instantiate(val_dataset, tokenizer=tokenizer)
        log_data_counts("val_dataset", validation)
        report_past_context(validation, "val_dataset", model_context)
        val_loader, _ = build_dataloader(
            validation, **common, **workers, shuffle=False, pad_id=tokenizer.pad_id
        )
    steps_per_epoch = len(loader) // gradient_accumulation_steps
    if max_steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, max_steps_per_epoch)
    if steps_per_epoch == 0:
        # A run of zero steps would "finish" with nothing trained and nothing exported.
        per_step = batch_size * gradient_accumulation_steps * sampler.num_replicas
        raise DataError(
            f"dataset: {len(train)} samples, but one optimizer step takes {per_step} "
            f"(batch_size {batch_size} x gradient_accumulation_steps "
            f"{gradient_accumulation_steps} x {sampler.num_replicas} data-parallel ranks): "
            "no step can run; use more data or a smaller batch"
        )
    samples_per_step = batch_size * gradient_accumulation_steps
    return TrainingData(
        loader, sampler, val_loader, steps_per_epoch, gradient_accumulation_steps, samples_per_step
    )


# What a built dataset left out, as its attributes count it, in the start line's words.
_LEFT_OUT = (
    ("num_skipped", "malformed rows skipped"),
    ("num_truncated", "truncated"),
    ("num_dropped", "dropped"),
)


def log_data_counts(name: str, dataset: Any) -> None:
    """Say at the start what the dataset left out, in one line.

    ``dataset: 298 items (malformed rows skipped: 2, truncated: 5, dropped: 0)``. A run with
    ``skip_malformed: true`` otherwise trains on fewer rows than the file holds without a
    word. Logged at INFO, which only rank 0 shows. A stream (``streaming: true``)
    skips its malformed rows as it reads them: nothing is counted ahead, nothing said here.

    Args:
        name: The dataset's setting (``dataset``, ``val_dataset``).
        dataset: The built dataset; the counts it has (``num_skipped``, ``num_truncated``,
            ``num_dropped``) are said, each even when 0.
    """
    if isinstance(dataset, StreamingDataset) or not hasattr(dataset, "__len__"):
        return
    counts = [
        f"{words}: {getattr(dataset, attribute)}"
        for attribute, words in _LEFT_OUT
        if isinstance(getattr(dataset, attribute, None), int)
    ]
    said = f" ({', '.join(counts)})" if counts else ""
    kind = "packs" if getattr(dataset, "packed", False) else "items"
    logger.info("%s: %d %s%s", name, len(dataset), kind, said)


def report_past_context(dataset: Any, key: str, model_context: int | None) -> int:
    """Log how many samples are longer than the model's context; return that number.

    Positions past ``max_position_embeddings`` are ones the model never saw in its own
    training (rotary angles it was not trained on): such samples train, but the run says how
    many there are and how to cut them (``max_seq_len``). A streamed dataset is not counted
    ahead.

    Args:
        dataset: A built dataset; counted when it has ``num_longer_than``.
        key: Its config key, for the message.
        model_context: The model's ``max_position_embeddings`` (None: nothing to check).

    Returns:
        The number of samples past the context (0 when not counted).
    """
    if model_context is None or not hasattr(dataset, "num_longer_than"):
        return 0
    longer = dataset.num_longer_than(model_context)
    if longer:
        logger.info(  # rank 0 only, like the data counts before it
            "%s: %d samples are longer than the model's context (max_position_embeddings %d) "
            "and train on positions past it; set %s.max_seq_len (or tokenizer.max_seq_len) "
            "to %d or less to cut them",
            key, longer, model_context, key, model_context,
        )  # fmt: skip
    return longer


def _stream_data(
    train: StreamingDataset,
    tokenizer: Any,
    common: dict[str, Any],
    val_dataset: Any,
    max_steps_per_epoch: int | None,
    index_pairs: bool,
    gradient_accumulation_steps: int,
) -> TrainingData:
    """``build_data`` for a ``StreamingDataset``: an epoch is ``max_steps_per_epoch`` steps."""
    if max_steps_per_epoch is None:
        raise ConfigError(
            "max_steps_per_epoch: dataset.streaming: true needs it (a stream's length is "
            "unknown, and the schedule and progress need the number of steps)"
        )
    if index_pairs:
        raise ConfigError("dataset.streaming: supports SFT recipes only")
    loader, position = build_stream_loader(train, **common, pad_id=tokenizer.pad_id)
    val_loader = None
    if val_dataset is not None:
        validation = instantiate(val_dataset, tokenizer=tokenizer)
        if isinstance(validation, StreamingDataset):
            raise ConfigError("val_dataset.streaming: validation data cannot stream")
        val_loader, _ = build_dataloader(
            validation, **common, shuffle=False, pad_id=tokenizer.pad_id
        )
    samples_per_step = common["batch_size"] * gradient_accumulation_steps
    return TrainingData(
        loader, position, val_loader, max_steps_per_epoch, gradient_accumulation_steps,
        samples_per_step,
    )  # fmt: skip


def keep_global_batch(
    run: RunFolder, batch_size: int, gradient_accumulation_steps: int, world_size: int
) -> tuple[int, int]:
    """The per-process batch and accumulation that keep a resumed run's global batch.

    ``batch_size`` is per process, so the same settings on another number of processes would
    change the samples per optimizer step, the step count and the schedule. The newest
    committed checkpoint records the global batch ``G``; on resume this keeps ``G``: the
    configured ``batch_size`` with ``G / (batch_size * world_size)`` accumulation steps when
    that divides, else the largest smaller ``batch_size`` that divides ``G / world_size``. The
    data order, step count and schedule are then those of the uninterrupted run. Rank 0 says
    what it chose in one line.

    Args:
        run: The run folder (nothing to keep when it holds no committed checkpoint, or one
            from before the global batch was recorded).
        batch_size: The configured samples per micro-batch per process.
        gradient_accumulation_steps: The configured micro-batches per optimizer step.
        world_size: Data-parallel ranks in this run (processes / ``ranks_per_sample``:
            the ranks of a context- or tensor-parallel group share their samples).

    Returns:
        ``(batch_size, gradient_accumulation_steps)`` to use.

    Raises:
        ConfigError: ``G`` cannot be split evenly over ``world_size`` processes.
    """
    committed = run.committed_checkpoints()
    recorded = _recorded_global_batch(committed[-1].path) if committed else None
    if recorded is None or recorded == batch_size * gradient_accumulation_steps * world_size:
        return batch_size, gradient_accumulation_steps
    name = committed[-1].path.name
    if recorded % world_size:
        raise ConfigError(
            f"{name} was trained with a global batch of {recorded} samples per step, which "
            f"{world_size} processes cannot split evenly: resume on a number of processes that "
            "divides it, or set allow_global_batch_change=true (the run then differs)"
        )
    per_process = recorded // world_size
    chosen = next(
        size for size in range(min(batch_size, per_process), 0, -1) if per_process % size == 0
    )
    accumulation = per_process // chosen
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(
            f"resume: keeping {name}'s global batch of {recorded} on {world_size} process(es): "
            f"batch_size {chosen}, gradient_accumulation_steps {accumulation} (configured "
            f"{batch_size} x {gradient_accumulation_steps})",
            flush=True,
        )
    return chosen, accumulation


def _recorded_global_batch(step_dir: Any) -> int | None:
    """The global batch a step checkpoint's trainer state records, or None."""
    from tunelab.checkpoint.state import TRAINER_STATE_NAME  # Imports torch: here, not on top.

    try:
        state = json.loads((step_dir / TRAINER_STATE_NAME).read_text())
        value = state["progress"]["global_batch"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # An older checkpoint, or one load_latest will refuse with its reason.
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def build_optimizer(
    optimizer: Any,
    params: Iterable[torch.Tensor],
    *,
    lr_scheduler: Any = None,
    num_training_steps: int,
) -> tuple[torch.optim.Optimizer, Any]:
    """Instantiate the optimizer over ``params`` and its LR schedule (None if not configured).

    Args:
        optimizer: The optimizer's component node (called with ``params``).
        params: The trainable parameters.
        lr_scheduler: The schedule's component node, or None for a constant LR.
        num_training_steps: Optimizer steps in the whole run.
    """
    built = instantiate(optimizer, params=params)
    schedule = None
    if lr_scheduler is not None:
        schedule = instantiate(lr_scheduler, optimizer=built, num_training_steps=num_training_steps)
    return built, schedule


@dataclass(frozen=True)
class TrainState:
    """What a step checkpoint saves: the model, the optimizer and the LR schedule.

    Args:
        model: The model.
        optimizer: The optimizer.
        lr_scheduler: The LR schedule (None: constant LR).
        lora: The LoRA record: checkpoints hold the adapters only and exports are LoRA
            exports; None for full fine-tuning.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any = None
    lora: LoRAArgs | None = None


def build_checkpoint_client(
    run: RunFolder,
    checkpoint: CheckpointArgs,
    state: TrainState,
    *,
    base_checkpoint_dir: str,
    tokenizer: Any = None,
    config_hash: str = "",
) -> CheckpointClient:
    """The run's ``CheckpointClient`` (call after ``init_distributed``).

    Args:
        run: The run's folder.
        checkpoint: The ``checkpoint`` settings (async saves, retention).
        state: The model, optimizer and schedule whose state is saved (and the LoRA record).
        base_checkpoint_dir: The base model's folder (exports copy its files).
        tokenizer: With it, exports also carry what it adds to the base model's files (an
            overridden chat template), so the model is served with the template it was
            trained on.
        config_hash: Recorded in manifests (``config_fingerprint``).
    """
    # Imported here: tunelab.checkpoint imports tunelab.training (RNG state) as it loads.
    from tunelab.checkpoint import CheckpointClient

    return CheckpointClient(
        run,
        model=state.model,
        optimizer=state.optimizer,
        lr_scheduler=state.lr_scheduler,
        base_checkpoint_dir=base_checkpoint_dir,
        lora=state.lora,
        enable_async=checkpoint.enable_async_checkpointing,
        keep_last_n=checkpoint.keep_last_n_checkpoints,
        gguf_quantization=(
            checkpoint.gguf_quantization if "gguf" in checkpoint.export_formats else None
        ),
        config_hash=config_hash,
        export_files=tokenizer.extra_files() if hasattr(tokenizer, "extra_files") else None,
    )


def resume(checkpoints: CheckpointClient, data: TrainingData, mode: bool | str) -> tuple[int, int]:
    """Restore the newest committed checkpoint as ``checkpoint.resume_from_checkpoint`` says.

    ``true`` resumes (``RunFolder.start`` already refused a folder with nothing to resume);
    ``"auto"`` resumes when there is a committed checkpoint and starts fresh otherwise (what a
    scheduler's restart loop needs); ``false`` starts fresh. Rank 0 prints what was done.

    Returns:
        ``(global_step, start_epoch)``: ``(0, 0)`` for a fresh run.
    """
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    # A torchrun restart (--max-restarts) says so: "restart 1 of 2: resumed from step_4 ...".
    restart, max_restarts = restart_of_job()
    said = f"restart {restart} of {max_restarts}: " if restart else ""
    if mode is False:
        return 0, 0
    resumed = checkpoints.load_latest()
    if resumed is None:
        if is_main:
            print(f"{said}no checkpoint in {checkpoints.run}: starting fresh", flush=True)
        return 0, 0
    data.sampler.load_state_dict(resumed.progress["sampler"])
    data.resumed_progress = resumed.progress
    start_epoch = resumed.epoch + 1 if resumed.progress["epoch_done"] else resumed.epoch
    if is_main:
        step_in_epoch = 0 if resumed.progress["epoch_done"] else data.step_in_epoch()
        print(
            f"{said}resumed from {resumed.path.name} (epoch {start_epoch}, step {step_in_epoch} "
            f"of {data.steps_per_epoch})",
            flush=True,
        )
    return resumed.step, start_epoch


@dataclass(frozen=True)
class Schedule:
    """When to log, validate, export and save.

    Args:
        schedule: The ``schedule`` settings (epochs, log and validation intervals).
        checkpoint: The ``checkpoint`` settings (save and export intervals).
    """

    schedule: ScheduleArgs
    checkpoint: CheckpointArgs

    @property
    def epochs(self) -> int:
        """Epochs in the run."""
        return self.schedule.epochs

    def validate(self, global_step: int, epoch_done: bool) -> bool:
        """Every ``run_val_every_n_steps`` and at each epoch end."""
        return epoch_done or _every(global_step, self.schedule.run_val_every_n_steps)

    def export(self, epoch: int, epoch_done: bool) -> bool:
        """At epoch ends, every ``export_every_n_epochs`` and always the last."""
        return epoch_done and (
            self.is_last(epoch, epoch_done)
            or _every(epoch + 1, self.checkpoint.export_every_n_epochs)
        )

    def save(self, global_step: int, epoch_done: bool) -> bool:
        """Every ``save_every_n_steps`` and at each epoch end."""
        return epoch_done or _every(global_step, self.checkpoint.save_every_n_steps)

    def log(self, global_step: int) -> bool:
        """Every ``log_every_n_steps``."""
        return _every(global_step, self.schedule.log_every_n_steps)

    def is_last(self, epoch: int, epoch_done: bool) -> bool:
        """Whether this step ends the run (its save has nothing left to overlap with)."""
        return epoch_done and epoch == self.epochs - 1


class StepBenchmarks(Protocol):
    """Benchmarks run between steps (``tunelab.eval.TrainingEval``): when, and the scores."""

    def due(self, global_step: int, last_step: bool) -> bool:
        """Whether to run after ``global_step`` (``last_step``: it ends the run)."""

    def __call__(self) -> dict[str, float]:
        """Run on every rank; return the metrics to log (rank 0 has the scores)."""


@dataclass(frozen=True)
class StepReports:
    """What :class:`AfterStep` reports a step to, and the measurements it runs.

    Args:
        loggers: The metric loggers (``MetricLoggers``).
        profiler: Records a few steps when enabled.
        validate: Returns the validation metrics (``{"val_loss": ...}``), or None without
            validation data.
        benchmarks: lm-eval tasks on the live model (``tunelab.eval.TrainingEval``), logged
            at the steps they are due; None: none.
    """

    loggers: MetricLoggers
    profiler: StepProfiler
    validate: Callable[[], dict[str, float]] | None = None
    benchmarks: StepBenchmarks | None = None


class AfterStep:
    """What every training recipe does after its optimizer step, in this order.

    Advance the progress bar and the profiler; log the step's metrics; validate; run the
    benchmarks when due; export at an epoch end; save a step checkpoint; and, when a SIGTERM
    or SIGINT arrived, stop with a committed checkpoint at a step every rank agrees on. Built
    after resume (it starts the progress bar at the resumed step and arms the stop handling).

    The step's tokens/s is measured from :meth:`start_step` to the start of this call:
    validation, benchmarks and saves are not in it. Validation and benchmarks are logged
    before the step's checkpoint is saved, so a run resumed from that checkpoint does not
    repeat them, and one resumed from an earlier checkpoint logs them once more after the
    per-step logs dropped the records past that checkpoint (``RunFolder.trim_step_logs``, and
    ``MetricLoggers.start_at`` for a logger's own files).

    Args:
        checkpoints: The run's checkpoint client.
        data: The training data (its position goes into each checkpoint).
        schedule: When to log, validate, export and save.
        reports: The loggers, the profiler, validation and the benchmarks.
        global_step: The step the run starts from (``resume``).
        device: For the peak-memory figure.

    Rank 0 draws the progress bar and trims the step logs.
    """

    def __init__(
        self,
        checkpoints: CheckpointClient,
        data: TrainingData,
        schedule: Schedule,
        reports: StepReports,
        *,
        global_step: int,
        device: torch.device,
    ) -> None:
        self.checkpoints, self.data, self.schedule = checkpoints, data, schedule
        loggers = reports.loggers
        self.loggers, self.validate, self.profiler = loggers, reports.validate, reports.profiler
        self.benchmarks, self.device = reports.benchmarks, device
        is_main = not dist.is_initialized() or dist.get_rank() == 0
        if is_main:
            # Every per-step log (metrics, completions, ...) loses the steps after the one the
            # run starts from: it logs them again.
            checkpoints.run.trim_step_logs(global_step)
        loggers.start_at(global_step)
        total = data.steps_per_epoch * schedule.epochs
        self.progress = ProgressBar(total, initial=global_step, enabled=is_main)
        # From here a SIGTERM or SIGINT stops the run at the end of a step, with a checkpoint.
        self.preemption = Preemption(checkpoints, close=(self.progress, loggers))
        self._start = time.perf_counter()
        # Tensor-parallel ranks share their samples: the recipes' token counts, summed over
        # every process, hold each token once per rank of a group.
        self._token_copies = tensor_parallel_size(checkpoints.model)

    def start_step(self) -> None:
        """Start the clock of a step (for its tokens/s)."""
        self._start = time.perf_counter()

    def __call__(
        self,
        global_step: int,
        epoch: int,
        step_in_epoch: int,
        metrics: dict[str, float],
        *,
        num_tokens: float,
    ) -> None:
        """Do the bookkeeping of the step just taken.

        Args:
            global_step: Optimizer steps taken in the run, this one included.
            epoch: The epoch of this step.
            step_in_epoch: Optimizer steps taken in this epoch, this one included.
            metrics: The step's metrics, with at least ``loss`` and ``lr``.
            num_tokens: Tokens the step trained on, summed over all ranks (``global_token_count``:
                tensor-parallel ranks count their shared samples each; logged once).

        Raises:
            TrainingStopped: A stop signal arrived; the checkpoint of this step is committed.
        """
        self.profiler.step()
        self.data.advance()
        seconds = time.perf_counter() - self._start
        tokens_per_second = num_tokens / self._token_copies / seconds
        self.progress.update(
            loss=metrics["loss"],
            lr=metrics["lr"],
            tokens_per_second=tokens_per_second,
            reward=metrics.get("reward"),  # RL recipes' mean reward of the step
        )
        schedule = self.schedule
        if schedule.log(global_step):
            metrics = {
                "num_tokens": num_tokens / self._token_copies,  # a recipe's own count wins
                **metrics,
                "tokens_per_second": tokens_per_second,
                "peak_memory_gib": peak_memory_gib(self.device),
            }
            self.loggers.log(metrics, global_step)
        epoch_done = step_in_epoch == self.data.steps_per_epoch
        if self.validate is not None and schedule.validate(global_step, epoch_done):
            self.loggers.log(self.validate(), global_step)
        if self.benchmarks is not None and self.benchmarks.due(
            global_step, schedule.is_last(epoch, epoch_done)
        ):
            self.loggers.log(self.benchmarks(), global_step)
        if schedule.export(epoch, epoch_done):
            self.checkpoints.export(epoch)
        saved = schedule.save(global_step, epoch_done)
        if saved:
            self.checkpoints.save(
                global_step,
                epoch,
                self.data.progress(epoch_done),
                # Nothing is left to overlap the run's last save with: write it in place.
                blocking=schedule.is_last(epoch, epoch_done),
            )
        if self.preemption.stop_agreed():  # A collective: every rank asks once per step.
            self.preemption.stop(global_step, epoch, self.data.progress(epoch_done), saved=saved)

    def close(self) -> None:
        """Finish the progress bar and profiler, wait for the last save, close the loggers."""
        self.progress.close()
        self.profiler.close()
        self.checkpoints.close()
        self.loggers.close()


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
