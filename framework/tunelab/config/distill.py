"""Settings of distill_distributed: the teacher and on-policy sections, and the recipe's record.

This module must not import torch: ``tunelab validate`` imports it to check a config.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from tunelab.config._args import Component, component
from tunelab.config._model_dir import read_json
from tunelab.config._teacher_vocab import map_vocabularies
from tunelab.config.constraints import Finite, Range
from tunelab.config.lora import LoRAArgs
from tunelab.config.recipe_args import LoRARecipeArgs
from tunelab.config.sections import AtLeastOne, ModelSetupArgs


@dataclass(kw_only=True)
class TeacherArgs(ModelSetupArgs):
    """The frozen teacher: its folder and dtype (its own), how it is built and sharded."""

    reshard_after_forward: bool = True
    """FSDP2: free the teacher's gathered weights after each block's forward (false: gather each block once and keep it: a replicated teacher, for a teacher small enough to fit every process)."""
    precompute_top_k: bool = False
    """Offline steps read the teacher's top-k log-probs (loss.top_k, at loss.temperature) from a checksummed cache stored with the dataset's tokenized cache, computed once by one teacher pass over the dataset and reused by runs of the same teacher weights, dtype, tokenizer, top_k and temperature; the teacher is then loaded only for validation or on-policy steps."""


@dataclass(kw_only=True)
class OnPolicyArgs:
    """On-policy distillation: the share of steps trained on the student's own samples."""

    lmbda: Annotated[float, Range(ge=0, le=1)] = 0.0
    """Probability that a step trains on completions the student samples for its batch's prompts (a seeded draw per step; 0: offline on the dataset's own completions, 1: always on-policy)."""
    max_new_tokens: AtLeastOne = 32
    """Tokens a sampled completion has at most."""
    temperature: Annotated[float, Finite(), Range(gt=0)] = 1.0
    """Sampling temperature of the student's completions."""
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches it."""
    top_k: AtLeastOne | None = None
    """Sample among the k most likely tokens (None: all)."""
    gather_once: bool = True
    """FSDP2: gather the student's weights once per sampling call and hold them until its last token (false: gather block by block for every token)."""


def _vocab_size(model_dir: str) -> int | None:
    config, problem = read_json(Path(model_dir).expanduser() / "config.json")
    if problem or not isinstance(config, dict):
        return None
    value = config.get("vocab_size")
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(kw_only=True)
class DistillArgs(LoRARecipeArgs):
    """Settings of distill_distributed: a student learns a frozen teacher's token distribution."""

    lora: LoRAArgs | None = field(default_factory=LoRAArgs)
    """The student's LoRA adapters (the lora.* keys of lora_finetune_distributed, lora.quantize_base: nf4 for QLoRA); null: full fine-tuning of the student."""
    teacher: TeacherArgs
    """The frozen teacher: a model of the student's tokenizer family (the same ordinary tokens; special tokens are mapped by content), its own folder and dtype."""
    dataset: Component = component(call_args=("tokenizer",))
    """An SFT or chat dataset (masks as in SFT); on-policy steps take each row's prompt (the tokens before its first target) and sample a completion."""
    val_dataset: Component | None = component(required=False, call_args=("tokenizer",))
    """An optional SFT or chat dataset: val_loss (the distillation loss), val_nll and the teacher's val_teacher_nll."""
    loss: Component = component(default="tunelab.losses.ForwardKLLoss")
    """The distillation loss, a tunelab.losses.DistillationLoss: ForwardKLLoss, ReverseKLLoss or GeneralizedJSDLoss (beta), each with temperature, top_k, nll_weight."""
    on_policy: OnPolicyArgs = field(default_factory=OnPolicyArgs)
    """On-policy steps: their share (lmbda) and how the student samples."""

    def check_settings(self) -> list[str]:
        """Teacher and student must share one tokenizer family (special tokens may differ)."""
        problems = super().check_settings() + self.teacher.check_settings()
        problems += self._parallelism_problems()
        student, teacher = _vocab_size(self.model.path), _vocab_size(self.teacher.path)
        if student is not None and teacher is not None:
            try:
                map_vocabularies(self.student_tokenizer_dir(), self.teacher.path, student, teacher)
            except (ValueError, OSError) as error:
                problems.append(f"key 'teacher.path': {error} ({self.teacher.path})")
        return problems

    def _parallelism_problems(self) -> list[str]:
        """What tensor and expert parallelism do not cover in distillation yet, one line each."""
        problems = []
        parallelism = self.parallelism
        tensor, expert = parallelism.tensor_parallel_size, parallelism.expert_parallel_size
        if tensor > 1:
            setting = f"key 'parallelism.tensor_parallel_size': {tensor}"
            if self.model.chunked_output:
                problems.append(
                    f"{setting} with model.chunked_output: true is not built for distillation "
                    "yet (its losses read each position's whole vocabulary, which tensor "
                    "parallelism splits over the ranks): set model.chunked_output: false"
                )
            if self.teacher.precompute_top_k:
                problems.append(f"{setting} with teacher.precompute_top_k: true is not built yet")
        for size, name in ((tensor, "tensor_parallel_size"), (expert, "expert_parallel_size")):
            if size > 1 and self.on_policy.lmbda > 0:
                # Sampling runs a forward per new token, as many as each rank's completions
                # need: the ranks' collectives inside the model would not pair up.
                problems.append(
                    f"key 'parallelism.{name}': {size} with on_policy.lmbda > 0 is not built yet "
                    "(on-policy sampling under split matmuls or experts)"
                )
        return problems

    def student_tokenizer_dir(self) -> str:
        """The folder of the student's ``tokenizer.json``: ``tokenizer.path``, else the model's."""
        path = self.tokenizer.get("path") if hasattr(self.tokenizer, "get") else None
        return path if isinstance(path, str) and path else self.model.path
