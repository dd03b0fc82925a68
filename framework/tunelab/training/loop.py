"""Building blocks of a recipe's training step.

The step itself (micro-batches, forward, loss, scaling, backward) is written out in each
recipe; these are the pieces it calls: move a batch, run the model, count the step's target
tokens, clip and step the optimizer behind the non-finite guard, validate, measure memory.
"""

import contextlib
import logging
import math
import resource
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from tunelab.config.sections import RouterArgs, ScheduleArgs
from tunelab.distributed import ContextParallel, all_reduce_sum, reshard
from tunelab.distributed.grad_norm import clip_grad_norm_
from tunelab.distributed.tensor_parallel import (
    sequence_parallel_tokens,
    tensor_parallel_output,
    tensor_parallel_size,
)
from tunelab.errors import DataError, TrainingError
from tunelab.losses import OutputLayer, scored_rows, token_count
from tunelab.models import TransformerDecoder
from tunelab.modules.moe import RouterStats

logger = logging.getLogger(__name__)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Move every tensor of a batch to ``device``."""
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def output_layer(model: nn.Module) -> OutputLayer:
    """The model's output layer, for a loss that applies it chunk by chunk.

    Pass it to :func:`forward` (which then returns the final hidden states) and to the loss.
    Under FSDP2 the root module keeps its parameters (``lm_head``) gathered from its forward to
    its backward (``shard_model`` does not reshard the root after forward), so the loss can
    call the layer after the model's forward and in the backward. Under tensor parallelism
    it computes this rank's part of the vocabulary (``tensor_parallel_output``).
    """
    trainable = any(param.requires_grad for param in model.lm_head.parameters())
    sharded = tensor_parallel_output(model)
    if sharded is not None:
        return OutputLayer(sharded[0], trainable, model.args.vocab_size, vocab_group=sharded[1])
    output = getattr(model, "output", None) or model.lm_head
    return OutputLayer(output, trainable, model.args.vocab_size)


VISUAL_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)
"""A vision-language batch's inputs beside its tokens (images, videos), passed as they are."""


def forward(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    output: OutputLayer | None = None,
    router_stats: RouterStats | None = None,
    context: ContextParallel | None = None,
) -> torch.Tensor:
    """Run the model on a collated batch; packed batches attend within their documents.

    Packed batches pass their ``document_ids``: the model's ``attention_backend`` builds what
    its kernel needs (a flex ``BlockMask``, or a dense mask on the fallback path).

    With ``output`` the loss reads the final hidden states at the scored positions only
    (``tunelab.losses.scored_rows`` of ``batch["labels"]``), so the model computes its last
    layer past attention (``o_proj``, MLP, norms) at those rows only and returns ``[rows,
    dim]`` (``TransformerDecoder.forward(rows=...)``; image tokens and prompts skip most of a
    layer). The layouts that keep every position (``[batch, seq, dim]``, which the losses
    take alike): a batch without labels; a router loss (``router_stats``: the last layer's
    routing of every token is part of it); context and tensor parallelism (the rows of a
    sequence split over ranks); dropout in the last layer (its masks drawn per row).

    Args:
        model: The decoder.
        batch: ``tokens`` (and for packed batches ``document_ids`` and ``input_pos``).
        output: The model's :func:`output_layer` when the loss applies it chunk by chunk.
        router_stats: Records a mixture-of-experts model's routing (:class:`RouterLoss`).
        context: Context parallelism: ``batch`` is this rank's slice
            (``ContextParallel.shard``).

    Returns:
        Logits ``[batch, seq, vocab]``, or with ``output`` the final hidden states
        ``[rows, dim]`` of the scored positions (``[batch, seq, dim]`` where the layout keeps
        every position).
    """
    hidden = output is not None
    routing = {} if router_stats is None else {"router_stats": router_stats}
    if context is not None and context.enabled:
        return model(
            batch["tokens"],
            document_ids=batch.get("document_ids"),
            input_pos=batch["input_pos"],
            return_hidden=hidden,
            context_parallel=context,
            **routing,
        )
    rows = scored_rows_only(model, batch, output, router_stats)
    visual = {key: batch[key] for key in VISUAL_INPUTS if key in batch}
    if visual:
        # Images or videos (a vision-language model): it computes its own M-RoPE positions.
        return model(
            batch["tokens"],
            **visual,
            document_ids=batch.get("document_ids"),
            return_hidden=hidden,
            **rows,
        )
    if "document_ids" in batch:
        return model(
            batch["tokens"],
            document_ids=batch["document_ids"],
            input_pos=batch["input_pos"],
            return_hidden=hidden,
            **routing,
            **rows,
        )
    return model(batch["tokens"], return_hidden=hidden, **routing, **rows)


def scored_rows_only(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    output: OutputLayer | None,
    router_stats: RouterStats | None = None,
) -> dict[str, torch.Tensor]:
    """The forward's ``rows`` keyword (the scored positions), or nothing for every position.

    Context parallelism never reaches here (:func:`forward` returns before); tensor
    parallelism keeps every position: its row-wise ``o_proj`` reduce-scatters the sequence
    split over the ranks, which a subset of rows is not. So does a last layer that draws
    dropout masks (LoRA's ``dropout`` while training): a mask drawn for fewer rows takes other
    random numbers than the full forward's (and tensor parallelism's) would.
    ``model.trim_last_layer: false`` (the decoder's ``trim_last_layer``) keeps every position
    too: the layouts above then compare with a 1-process run computed the same way.

    Args:
        model: The decoder.
        batch: The collated batch (its ``labels`` name the scored positions).
        output: The chunked output layer, or None (whole logits: every position).
        router_stats: A mixture of experts' routing record, or None.

    Returns:
        ``{"rows": scored_rows(labels)}``, or ``{}``.
    """
    if (
        output is None
        or router_stats is not None
        or "labels" not in batch
        or not isinstance(model, TransformerDecoder)
        or not model.trim_last_layer
        or tensor_parallel_size(model) > 1
        or _draws_dropout(model.layers[-1])
    ):
        return {}
    return {"rows": scored_rows(batch["labels"])}


def _draws_dropout(module: nn.Module) -> bool:
    # An active dropout anywhere in ``module`` (training, p > 0).
    return any(
        isinstance(part, nn.Dropout) and part.training and part.p > 0 for part in module.modules()
    )


def batch_loss(
    loss_fn: nn.Module,
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    output: OutputLayer | None = None,
    router_stats: RouterStats | None = None,
    context: ContextParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's forward on ``batch`` and ``loss_fn`` of it: ``(loss_sum, num_tokens)``.

    With ``context`` (context parallelism) ``batch`` is this rank's slice, whose ``labels``
    are shifted with one leading ignored column (``ContextParallel.shard``): the model's
    output gets one unscored position appended, so a loss that pairs ``logits[:, :-1]`` with
    ``labels[:, 1:]`` scores every local position against its own target.

    With ``output`` (the model's :func:`output_layer`) the model returns its hidden states and
    the loss applies the output layer chunk by chunk: the logits never exist whole. Without,
    the loss gets the logits (any loss taking ``(logits, labels)`` works). ``router_stats``
    records a mixture-of-experts model's routing during the forward (:class:`RouterLoss`).
    """
    result = forward(model, batch, output, router_stats, context)
    if context is not None and context.enabled:
        result = F.pad(result, (0, 0, 0, 1))
    if output is None:
        return loss_fn(result, batch["labels"])
    return loss_fn(result, batch["labels"], output=output)


class RouterLoss:
    """A mixture-of-experts model's load-balancing loss, added to the training objective.

    Each micro-batch's forward records its routing (:meth:`stats`: the tokens of
    ``token_mask`` count, padding does not; packed documents all do, as transformers'
    ``load_balancing_loss_func`` with an ``attention_mask``); its loss, times the
    coefficient and divided by the step's micro-batches (:meth:`term`), joins that
    micro-batch's backward, so the step's router term is the mean over micro-batches and
    (FSDP2 averaging gradients) ranks, as in transformers' training loss. The logged
    ``router_aux_loss`` (:meth:`step_metrics`) is that mean, before the coefficient; the
    logged ``loss`` stays the token loss. The router z-loss (``RouterStats.z_loss``, ST-MoE
    eq. 5) joins the same way with its own coefficient and is logged as ``router_z_loss``.
    A dense model, or both coefficients 0: every method is a no-op.

    Args:
        model: The decoder (sharded or not).
        router: The ``router`` settings: ``aux_loss_coef``, the load-balancing weight (None
            takes the model's ``router_aux_loss_coef`` when its ``config.json`` sets
            ``output_router_logits: true``, when transformers adds it to the loss, else 0),
            and ``z_loss_coef``, the z-loss weight (0: none).
        context: Context parallelism: the statistics are summed over the ranks that split
            the rows, so each rank's losses are those of the whole rows (and their logged
            values the unsplit ones), and the term is scaled by the group size, since FSDP2
            then averages over every rank of the group where the unsplit run has one.

    Under tensor parallelism (a mixture of experts with its experts split) each tp rank
    routes its own part of the sequence: the statistics are summed over the tp ranks in the
    same way (``sequence_parallel_tokens``), the term unscaled (FSDP2 averages over the
    data-parallel ranks only, and DTensor sums the router's gradient over the tp ranks).
    """

    def __init__(
        self,
        model: nn.Module,
        router: RouterArgs,
        context: ContextParallel | None = None,
    ) -> None:
        model_args = model.args  # the decoder's ModelArgs: is it MoE, and its own default
        is_moe = model_args.num_experts > 0
        coefficient = router.aux_loss_coef
        if coefficient is None:
            coefficient = model_args.default_router_aux_loss_coef
        self.coefficient = float(coefficient) if is_moe else 0.0
        self.z_coefficient = float(router.z_loss_coef) if is_moe else 0.0
        self.context = context if context is not None and context.enabled else None
        self._model = model if tensor_parallel_size(model) > 1 else None
        self._device = next(model.parameters()).device
        self._sum = torch.zeros(2, dtype=torch.float64, device=self._device)
        self._count = 0

    @property
    def enabled(self) -> bool:
        """Whether the model routes and a router loss has a weight."""
        return self.coefficient > 0 or self.z_coefficient > 0

    def stats(self, batch: dict[str, torch.Tensor]) -> RouterStats | None:
        """A record for one micro-batch's forward, or None when disabled."""
        if not self.enabled:
            return None
        if self._model is not None:  # tensor-parallel: this rank's tokens
            split = sequence_parallel_tokens(self._model, batch.get("token_mask"), batch["tokens"])
            return RouterStats(*split)
        sum_over_ranks = None if self.context is None else self.context.sum_over_group
        return RouterStats(batch.get("token_mask"), sum_over_ranks)

    def term(self, stats: RouterStats | None, num_micro_batches: int) -> torch.Tensor | float:
        """The micro-batch's share of the objective.

        ``(coefficient * loss + z_coefficient * z_loss) / micro-batches`` (times the group size
        under context parallelism).
        """
        if stats is None:
            return 0.0
        loss = stats.loss()
        # The z-loss only when weighted: under context parallelism it is one more collective.
        z_loss = stats.z_loss() if self.z_coefficient > 0 else torch.zeros((), device=loss.device)
        self._sum = self._sum + torch.stack([loss.detach(), z_loss.detach()]).to(self._sum)
        self._count += 1
        ranks = 1 if self.context is None else self.context.size
        objective = loss * self.coefficient + z_loss * self.z_coefficient
        return objective * (ranks / num_micro_batches)

    def step_metrics(self) -> dict[str, float]:
        """The step's ``router_aux_loss`` and ``router_z_loss``: means over micro-batches and ranks.

        Each is logged when its coefficient is set. A collective when enabled (every rank calls
        it); then the next step starts from zero. ``{}`` when disabled.
        """
        if not self.enabled:
            return {}
        count = torch.tensor([float(self._count)], dtype=torch.float64, device=self._device)
        total = all_reduce_sum(torch.cat([self._sum, count]))
        self._sum, self._count = torch.zeros_like(self._sum), 0
        means = (total[:2] / total[2].clamp(min=1)).tolist()
        metrics = {}
        if self.coefficient > 0:
            metrics["router_aux_loss"] = means[0]
        if self.z_coefficient > 0:
            metrics["router_z_loss"] = means[1]
        return metrics


class ActivationOffload:
    """Saved activations in pinned host memory during a forward: ``with offload(): ...``.

    On CUDA each tensor autograd saves for the backward is copied to pinned CPU memory in the
    forward and back to the GPU when the backward needs it
    (``torch.autograd.graph.save_on_cpu(pin_memory=True)``): GPU memory for activations drops
    to about one layer's working set, at the cost of two host copies of every saved tensor.
    With activation checkpointing only the checkpointed blocks' inputs are saved, so the two
    combine. On CPU the activations already live in host memory: a no-op, said in one line.

    Args:
        enabled: ``offload_activations``.
        device: Where the model computes.
    """

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.active = enabled and device.type == "cuda"
        is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if enabled and not self.active and is_main:
            logger.warning(
                "offload_activations: activations on %s already live in host memory: no-op",
                device.type,
            )

    def __call__(self) -> contextlib.AbstractContextManager:
        """A context whose forward saves its activations on the host (or does nothing)."""
        if not self.active:
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=True)


def global_token_count(micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Target tokens of one optimizer step, summed over micro-batches and ranks.

    The loss of a step is ``sum of token losses / this count``, so every token weighs the
    same whatever the padding, the micro-batching or the world size.

    Raises:
        DataError: The step has no target token at all (on every rank alike).
    """
    count = sum(token_count(batch["labels"]) for batch in micro_batches)
    total = all_reduce_sum(count.to(torch.float64))
    if total.item() == 0:
        # Training on it would give a loss of 0 and no gradient: a silent no-op step.
        raise DataError(
            "an optimizer step has no target token in any batch on any rank: every label is "
            "masked (check the dataset's template, train_on_input and max_seq_len, and that "
            "the tokenizer fits the data)"
        )
    return total


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    loss_fn: nn.Module,
    device: torch.device,
    output: OutputLayer | None = None,
    context: ContextParallel | None = None,
) -> float:
    """Mean token loss over a whole validation loader, over all ranks.

    ``output``: the model's :func:`output_layer` when the loss applies it chunk by chunk;
    ``context``: context parallelism (each batch is split over the cp group). The
    loss is also a ``validation loss X`` log line (INFO: shown on rank 0, between progress-bar
    refreshes), so it is on the console when it is computed, not only in the metric loggers.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in loader:
        batch = to_device(batch, device)
        if context is not None:
            batch = context.shard(batch)
        loss_sum, num_tokens = batch_loss(loss_fn, model, batch, output, context=context)
        totals += torch.stack([loss_sum.double(), num_tokens.double()])
    all_reduce_sum(totals)
    # An FSDP2 root keeps unsharded parameters after a no_grad forward (TORCH_NOTES).
    reshard(model)
    model.train(was_training)
    val_loss = (totals[0] / totals[1].clamp_min(1)).item()
    logger.info("validation loss %.4f", val_loss)
    return val_loss


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations, or resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    return max_rss / (2**30 if sys.platform == "darwin" else 2**20)


class NonFiniteGuard:
    """Stops training at a step whose loss or gradient norm is NaN or infinite.

    A non-finite step would write NaNs into every weight it updates, and training would go on
    (and export) silently. With ``skip_budget`` > 0 the first ``skip_budget`` such steps are
    skipped instead (no update, gradients dropped, a warning each), as some users prefer for a
    rare bad batch; the next one stops the run.

    Args:
        skip_budget: Non-finite steps to skip before stopping (0: stop at the first).
    """

    def __init__(self, skip_budget: int = 0) -> None:
        self.skip_budget = skip_budget
        self.skipped = 0

    def should_skip(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether to skip ``step``; False when both figures are finite.

        Raises:
            TrainingError: The step is not finite and the skip budget is spent.
        """
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return False
        what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
        if self.skipped >= self.skip_budget:
            hint = (
                f" ({self.skipped} earlier step(s) skipped)"
                if self.skipped
                else "; set skip_nonfinite_steps to skip a few such steps"
            )
            raise TrainingError(
                f"{what} is not finite: stopping before it changes the weights (lower the "
                f"learning rate, check the data and the dtype){hint}"
            )
        self.skipped += 1
        logger.warning(
            "%s is not finite: skipped (%d of %d allowed)", what, self.skipped, self.skip_budget
        )
        return True


class OptimizerStep:
    """Clip, step the optimizer and the schedule, zero the gradients: built once in set-up.

    Args:
        optimizer: The optimizer.
        params: The parameters it updates (their gradient norm is measured and clipped).
        lr_scheduler: Stepped after the optimizer, if given.
        clip_grad_norm: Clip the global gradient norm to this (None: no clipping;
            ``schedule.clip_grad_norm``).
        guard: Checks each step's loss and gradient norm first; a skipped step changes nothing.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[torch.Tensor],
        *,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        clip_grad_norm: float | None = None,
        guard: NonFiniteGuard | None = None,
    ) -> None:
        self.optimizer, self.params, self.lr_scheduler = optimizer, params, lr_scheduler
        self.clip_grad_norm, self.guard = clip_grad_norm, guard

    @classmethod
    def from_schedule(
        cls,
        optimizer: torch.optim.Optimizer,
        params: list[torch.Tensor],
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        schedule: ScheduleArgs,
    ) -> "OptimizerStep":
        """The step the ``schedule`` section describes (what every training recipe builds).

        Its ``clip_grad_norm``, and a ``NonFiniteGuard`` of its ``skip_nonfinite_steps``: a
        NaN/inf loss or gradient stops the run before the update, or is skipped within that
        budget.

        Args:
            optimizer: The optimizer.
            params: The parameters it updates.
            lr_scheduler: Stepped after the optimizer, if given.
            schedule: The recipe's ``schedule`` section.
        """
        return cls(
            optimizer,
            params,
            lr_scheduler=lr_scheduler,
            clip_grad_norm=schedule.clip_grad_norm,
            guard=NonFiniteGuard(schedule.skip_nonfinite_steps),
        )

    def __call__(self, loss: float = 0.0, step: int = 0) -> dict[str, float]:
        """Take one optimizer step.

        Args:
            loss: The step's loss (for ``guard``).
            step: The step's number (for ``guard``'s messages).

        Returns:
            ``lr`` (the rate this step used), ``grad_norm`` (before clipping) when clipping or
            guarding, and ``skipped`` (1.0) for a step the guard skipped.

        Raises:
            TrainingError: From ``guard``.
        """
        optimizer, clip_grad_norm, guard = self.optimizer, self.clip_grad_norm, self.guard
        metrics = {"lr": optimizer.param_groups[0]["lr"]}
        if clip_grad_norm is not None or guard is not None:
            max_norm = clip_grad_norm if clip_grad_norm is not None else math.inf
            norm = clip_grad_norm_(self.params, max_norm)  # over every mesh the params use
            metrics["grad_norm"] = (
                norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            ).item()
            if guard is not None and guard.should_skip(step, loss, metrics["grad_norm"]):
                optimizer.zero_grad(set_to_none=True)
                return {**metrics, "skipped": 1.0}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return metrics
