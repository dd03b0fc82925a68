"""Building blocks of the distillation recipe: the frozen teacher, on-policy batches, validation.

The recipe (``recipes/distill_distributed.py``) writes its step out: take the micro-batches
(on an on-policy step, replace each by the student's completions of its prompts), run the
teacher and the student, and back-propagate the distillation loss
(:class:`~tunelab.losses.DistillationLoss`). These are the parts it calls.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from tunelab.config._teacher_vocab import VocabularyMap, map_vocabularies
from tunelab.config.distill import OnPolicyArgs
from tunelab.distill.top_k_cache import TeacherTopKCache
from tunelab.distributed import all_reduce_sum, reshard
from tunelab.errors import ConfigError
from tunelab.losses import DistillationLoss, DistillationSums, OutputLayer, token_logps
from tunelab.losses.distillation import METRIC_NAMES
from tunelab.rl.rollout import ModelRolloutEngine, SamplingSettings
from tunelab.rl.step import rollout_batch, sampling_seeds
from tunelab.training import forward, output_layer, to_device

__all__ = [
    "OnPolicyBatches",
    "Teacher",
    "distill_batch",
    "evaluate_distillation",
    "step_metrics",
]


class Teacher:
    """The frozen teacher: no gradient, eval mode, its output layer applied by the loss.

    Its logits come in the student's vocabulary order: where the two tokenizers differ only in
    special tokens (or in padding rows), the teacher's logits are gathered by content
    (``tunelab.config._teacher_vocab.map_vocabularies``) and rank 0 says what was mapped in
    one line; any other difference is refused.

    Args:
        model: The teacher as ``build_model`` made it (sharded like the student, or kept
            gathered with ``teacher.reshard_after_forward: false``).
        student: The student.
        chunked: Whether the loss applies both output layers chunk by chunk
            (``model.chunked_output``).
        teacher_path: The teacher's folder (its ``tokenizer.json``), for the map and messages.
        student_tokenizer: The folder of the student's ``tokenizer.json`` (None: the
            vocabulary sizes must be equal).

    Raises:
        ConfigError: The vocabularies differ beyond special tokens and padding rows.
    """

    def __init__(
        self,
        model: nn.Module,
        student: nn.Module,
        *,
        chunked: bool,
        teacher_path: str,
        student_tokenizer: str | None = None,
    ):
        student_size, teacher_size = student.args.vocab_size, model.args.vocab_size
        try:
            if student_tokenizer is None and student_size != teacher_size:
                raise ValueError(
                    f"the teacher's vocabulary ({teacher_size} tokens) differs from the "
                    f"student's ({student_size})"
                )
            vocabulary = (
                map_vocabularies(student_tokenizer, teacher_path, student_size, teacher_size)
                if student_tokenizer is not None
                else VocabularyMap(None, [], [])
            )
        except ValueError as error:
            raise ConfigError(f"teacher.path: {error} ({teacher_path})") from None
        self.model = model.requires_grad_(False).eval()
        self.index: torch.Tensor | None = None
        if vocabulary.teacher_ids is not None:
            self.index = torch.tensor(vocabulary.teacher_ids, dtype=torch.long)
            # The teacher reads the student's tokens in its own ids (a padding row, which no
            # tokenizer produces, is clamped into range).
            self.input_index = self.index.clamp(max=teacher_size - 1)
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"teacher vocabulary: {vocabulary.describe()}", flush=True)
        self.output: OutputLayer | None = None
        if chunked:
            layer = output_layer(model)
            self.output = layer
            if self.index is not None:
                self.output = OutputLayer(
                    forward=lambda hidden: self._to_student(layer.forward(hidden)),
                    trainable=False,
                    vocab_size=student_size,
                )

    def _to_student(self, logits: torch.Tensor) -> torch.Tensor:
        # The teacher's logits in the student's vocabulary order; a student padding row (index
        # one past the teacher's rows) takes the position's smallest teacher logit.
        smallest = logits.min(dim=-1, keepdim=True).values
        index = self.index.to(logits.device)
        return torch.cat([logits, smallest], dim=-1).index_select(-1, index)

    @torch.no_grad()
    def states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The teacher's final hidden states (chunked) or logits of a batch (student order)."""
        if self.index is not None:
            tokens = batch["tokens"]
            batch = {**batch, "tokens": self.input_index.to(tokens.device)[tokens]}
        states = forward(self.model, batch, self.output)
        if self.output is None and self.index is not None:
            states = self._to_student(states)
        return states


def distill_batch(
    loss_fn: DistillationLoss,
    model: nn.Module,
    teacher: Teacher | TeacherTopKCache,
    batch: dict[str, torch.Tensor],
    output: OutputLayer | None,
) -> DistillationSums:
    """The teacher's and the student's forwards on ``batch``, and the loss between them.

    Args:
        loss_fn: The distillation loss.
        model: The student.
        teacher: The frozen teacher, or its precomputed top-k (then no teacher forward runs;
            the batch carries ``pair_index``).
        batch: ``tokens`` and ``labels`` (a collated SFT batch, or an on-policy one).
        output: The student's output layer (chunked logits), or None: whole logits.

    Returns:
        The loss sum (differentiable), the scored tokens and the metric sums.
    """
    if isinstance(teacher, TeacherTopKCache):
        cached = teacher.rows(batch, loss_fn.ignore_index)
        return loss_fn(forward(model, batch, output), cached, batch["labels"], output)
    teacher_states = teacher.states(batch)
    student_states = forward(model, batch, output)
    return loss_fn(student_states, teacher_states, batch["labels"], output, teacher.output)


def _prompt(tokens: torch.Tensor, labels: torch.Tensor, length: int) -> list[int]:
    # The tokens before the row's first target (at least one token).
    targets = (labels[:length] != -100).nonzero()
    first = int(targets[0]) if len(targets) else length
    return tokens[: max(first, 1)].tolist()


def _prompt_key(prompt: list[int]) -> int:
    # A stable number for a prompt's tokens: what its sampling seed derives from, so the
    # seed depends neither on the rank nor on the batch (an SFT row carries no index).
    return zlib.crc32(torch.tensor(prompt, dtype=torch.int64).numpy().tobytes())


class OnPolicyBatches:
    """On-policy steps: the student's own completions of its batches' prompts (GKD's ``lmbda``).

    Whether step ``s`` is on-policy is a draw from a generator seeded by the run's seed and
    ``s`` alone, the same on every rank, so a resumed run draws the same. On such a step each
    micro-batch's rows are cut to their prompts (the tokens before the first target), the
    student samples one completion of each (:class:`~tunelab.rl.ModelRolloutEngine`: KV
    cache, one generator per row seeded from the run's seed, the step and the prompt's
    tokens, so 1 or N processes and a resumed run sample the same tokens), and the batch
    becomes prompt + completion with only the completion scored.

    Args:
        engine: The sampler on the student.
        lmbda: Probability of an on-policy step.
        seed: The run's seed.
        pad_id: The tokenizer's padding id.
    """

    def __init__(self, engine: ModelRolloutEngine, lmbda: float, seed: int, pad_id: int) -> None:
        self.engine, self.lmbda, self.seed, self.pad_id = engine, lmbda, seed, pad_id

    @classmethod
    def from_settings(
        cls, model: nn.Module, on_policy: OnPolicyArgs, tokenizer: Any, seed: int
    ) -> OnPolicyBatches:
        """The sampler the ``on_policy`` section describes, taken whole."""
        settings = SamplingSettings(
            max_new_tokens=on_policy.max_new_tokens,
            temperature=on_policy.temperature,
            top_p=on_policy.top_p,
            top_k=on_policy.top_k,
            stop_ids=frozenset(tokenizer.stop_ids),
        )
        engine = ModelRolloutEngine(
            model,
            settings,
            pad_id=tokenizer.pad_id,
            decode=tokenizer.decode,
            gather_once=on_policy.gather_once,
        )
        return cls(engine, on_policy.lmbda, seed, tokenizer.pad_id)

    def chooses(self, step: int) -> bool:
        """Whether step ``step`` (0-based) trains on the student's samples."""
        if self.lmbda <= 0:
            return False
        draw_seed = sampling_seeds(self.seed, step, [-1], 1)[0]
        draw = torch.rand((), generator=torch.Generator().manual_seed(draw_seed))
        return bool(draw < self.lmbda)

    def sample(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """The batch's prompts with the student's completions (a collective under FSDP2).

        Args:
            batch: A collated SFT batch (``tokens``, ``labels``, ``token_mask``).
            step: The step being taken (0-based).

        Returns:
            ``tokens`` and ``labels`` (the completion tokens only), on the batch's device.
        """
        tokens, labels = batch["tokens"].cpu(), batch["labels"].cpu()
        lengths = batch["token_mask"].sum(-1).tolist()
        prompts = [_prompt(tokens[i], labels[i], lengths[i]) for i in range(len(lengths))]
        seeds = sampling_seeds(self.seed, step, [_prompt_key(p) for p in prompts], 1)
        completions = self.engine.generate(prompts, seeds)
        return rollout_batch(prompts, completions, self.pad_id, batch["tokens"].device)


@torch.no_grad()
def evaluate_distillation(
    model: nn.Module,
    teacher: Teacher,
    loader: DataLoader,
    loss_fn: DistillationLoss,
    device: torch.device,
    output: OutputLayer | None,
) -> dict[str, float]:
    """Validation over a whole loader, over all ranks: per-token means.

    Returns:
        ``val_loss`` (the distillation loss), ``val_nll`` (the student's next-token NLL),
        ``val_teacher_nll`` (the teacher's: what ``val_nll`` approaches) and
        ``val_teacher_kl`` (KL(teacher || student) at temperature 1).
    """
    was_training = model.training
    model.eval()
    # Sums over the loader and the ranks: loss, student NLL, teacher NLL, teacher KL, tokens.
    totals = torch.zeros(5, dtype=torch.float64, device=device)
    for batch in loader:
        batch = to_device(batch, device)
        teacher_states = teacher.states(batch)
        sums = loss_fn(
            forward(model, batch, output), teacher_states, batch["labels"], output, teacher.output
        )
        teacher_logps, _ = token_logps(teacher_states, batch["labels"], output=teacher.output)
        values = [
            sums.loss_sum,
            sums.metrics["nll"],
            -teacher_logps.sum(),
            sums.metrics["teacher_kl"],
            sums.num_tokens,
        ]
        totals += torch.stack([value.double().to(device) for value in values])
    all_reduce_sum(totals)
    reshard(model)
    model.train(was_training)
    means = (totals[:4] / totals[4].clamp_min(1)).tolist()
    return dict(
        zip(("val_loss", "val_nll", "val_teacher_nll", "val_teacher_kl"), means, strict=True)
    )


def step_metrics(sums: dict[str, torch.Tensor], num_tokens: float) -> dict[str, float]:
    """Per-token means of a step's metric sums, summed over ranks (one all-reduce)."""
    stacked = torch.stack([sums[name].double() for name in METRIC_NAMES])
    totals = all_reduce_sum(stacked).tolist()
    return {
        name: value / max(num_tokens, 1) for name, value in zip(METRIC_NAMES, totals, strict=True)
    }
