"""The typed settings of the built-in recipes.

Each default lives here, once; recipes read ``args.<field>`` and never ``cfg.get(key, default)``.
So do the values each setting allows (``Annotated[int, Range(ge=1)]``): ``parse_args``,
``tunelab validate`` and the generated docs/settings.md all read them from here.
A copied recipe can subclass these or declare its own ``RecipeArgs`` dataclass.

This module must not import torch: ``tunelab validate`` imports it to check a config.
"""

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from omegaconf import DictConfig

from tunelab.config._args import Component, RecipeArgs, component
from tunelab.config._component_rules import Template
from tunelab.config._gguf import gguf_quantizer_problem
from tunelab.config._model_dir import model_context_length, tokenizer_fits_model
from tunelab.config._tasks import task_path_problem
from tunelab.config.agentic_section import AgenticArgs
from tunelab.config.constraints import (
    ExistingPath,
    Finite,
    NonEmpty,
    OutputDir,
    Range,
)
from tunelab.config.lora import ADAPTER_CONFIG_NAME, LoRAArgs
from tunelab.config.sections import (
    AtLeastOne,
    LoRAModelSetupArgs,
    LoRASFTModelSetupArgs,
    ModelFolderArgs,
    ModelParallelismArgs,
    ModelSetupArgs,
    ParallelismArgs,
    ProfileArgs,
    RewardArgs,
    RewardModelSetupArgs,
    RolloutArgs,
    RouterArgs,
    ScheduleArgs,
    SFTModelSetupArgs,
    SFTParallelismArgs,
)

AdapterDir = Annotated[
    str, ExistingPath("dir", contains=("adapter_config.json", "adapter_model.safetensors"))
]
"""A PEFT adapter folder."""


@dataclass(kw_only=True)
class CheckpointArgs:
    """Intermediate checkpoints, resume and exports."""

    save_every_n_steps: AtLeastOne | None = None
    """Save a resumable checkpoint every N optimizer steps (None: only at epoch ends)."""
    enable_async_checkpointing: bool = False
    """Return from a save at once: stage to CPU during the next forward/backward, write in background."""
    keep_last_n_checkpoints: AtLeastOne | None = None
    """Keep only the newest N committed step checkpoints (None keeps all)."""
    resume_from_checkpoint: bool | Literal["auto"] = False
    """true: continue from the newest committed step checkpoint (an error if none); auto: resume if there is one, else start fresh."""
    export_every_n_epochs: AtLeastOne = 1
    """Export a Hugging Face model every N epochs; the last epoch always exports."""
    export_formats: Annotated[list[Literal["hf", "gguf"]], NonEmpty()] = field(
        default_factory=lambda: ["hf"]
    )
    """What each export writes: hf (the Hugging Face model, always written: the others are made from it) and gguf (llama.cpp / Ollama file and Modelfile in epoch_E/gguf/)."""
    gguf_quantization: Literal["f16", "bf16", "f32", "q8_0", "q4_0", "q4_k", "q6_k"] = "f16"
    """Tensor type of the gguf export (norms and biases stay f32, as llama.cpp's converter keeps them; q4_k and q6_k only where the installed gguf package has their quantizer: 0.19 has none)."""

    def check_settings(self) -> list[str]:
        """A gguf export's quantization needs the installed gguf package's quantizer for it."""
        if "gguf" not in self.export_formats:
            return []
        problem = gguf_quantizer_problem(self.gguf_quantization)
        return [] if problem is None else [f"key 'checkpoint.gguf_quantization': {problem}"]


@dataclass(kw_only=True)
class TrainingEvalArgs:
    """lm-evaluation-harness tasks scored on the live model during training."""

    tasks: list[Annotated[str, NonEmpty()]] | None = None
    """lm-eval tasks to score the model on while it trains: registry names (arc_easy, hellaswag, gsm8k), task YAML files, or folders of them (None: no evaluation)."""
    every_n_steps: AtLeastOne | None = None
    """Evaluate every N optimizer steps (None: only at the end, with at_end)."""
    at_end: bool = True
    """Also evaluate after the run's last step."""
    limit: AtLeastOne | None = None
    """Documents per task at most (None: all); at least the number of processes."""
    num_fewshot: Annotated[int, Range(ge=0)] | None = None
    """Examples in each prompt (None: each task's own setting)."""
    batch_size: AtLeastOne = 8
    """Sequences per forward, per process (scoring and generation)."""
    max_length: AtLeastOne | None = None
    """Longest model input in tokens; longer ones lose tokens from the left (None: the model's max_position_embeddings)."""
    max_gen_toks: AtLeastOne = 256
    """Tokens a generation task generates at most when the task does not say."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (for instruct/chat models)."""
    seed: int = 0
    """Seed of lm-eval's few-shot sampling and of sampled generations (the training random streams are left as they were)."""

    def check_settings(self) -> list[str]:
        """A schedule needs tasks and tasks need a schedule, lm-eval and existing task files."""
        if not self.tasks:
            if self.every_n_steps is not None:
                return ["key 'eval.every_n_steps': there are no eval.tasks to evaluate"]
            return []
        problems = []
        if self.every_n_steps is None and not self.at_end:
            problems.append(
                "key 'eval.tasks': no evaluation is scheduled: set eval.every_n_steps or "
                "eval.at_end: true"
            )
        if importlib.util.find_spec("lm_eval") is None:
            problems.append(
                "key 'eval.tasks': evaluation needs EleutherAI's lm-evaluation-harness "
                "(lm_eval): pip install 'tunelab[eval]'"
            )
        problems += [
            f"key 'eval.tasks': {problem}"
            for problem in map(task_path_problem, self.tasks)
            if problem is not None
        ]
        return problems


@dataclass(kw_only=True)
class FinetuneArgs(RecipeArgs):
    """Settings shared by the training recipes: the top-level keys and the common sections."""

    output_dir: Annotated[str, NonEmpty(), OutputDir()]
    """Folder for checkpoints (step_N/), exports (epoch_E/) and logs (logs/)."""
    output_dir_may_exist: bool = False
    """Let a first run write into a non-empty output_dir that tunelab did not make (tunelab never deletes or moves what it did not write there)."""
    seed: int = 0
    """Seed for initialisation, data order and dropout."""
    device: Literal["cpu", "cuda"] | None = None
    """Device to train on (None: CUDA when available)."""
    model: ModelSetupArgs
    """The model: its folder, dtype, attention, compile, activation checkpointing, sharding."""
    tokenizer: Component = component()
    """The tokenizer (tunelab.data.load_tokenizer)."""
    dataset: Component = component(call_args=("tokenizer",))
    """The training dataset; the recipe passes the tokenizer."""
    val_dataset: Component | None = component(required=False, call_args=("tokenizer",))
    """An optional validation dataset, evaluated every schedule.run_val_every_n_steps and at epoch ends."""
    optimizer: Component = component(call_args=("params",))
    """The optimizer; the recipe passes the trainable parameters."""
    lr_scheduler: Component | None = component(
        required=False, call_args=("optimizer", "num_training_steps")
    )
    """The LR schedule, stepped once per optimizer step (None: constant LR)."""
    loss: Component = component()
    """The loss: returns the summed token loss and the number of target tokens."""
    metric_loggers: list[Component] | None = component(required=False)
    """Where per-step metrics go (stdout, JSONL, TensorBoard, W&B)."""
    parallelism: ParallelismArgs = field(default_factory=ParallelismArgs)
    """How the processes split the work (HSDP sizes, collective timeout)."""
    schedule: ScheduleArgs = field(default_factory=ScheduleArgs)
    """Epochs, batches, accumulation, clipping, and the log and validation intervals."""
    profile: ProfileArgs = field(default_factory=ProfileArgs)
    """torch.profiler traces of a few steps."""
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    """Intermediate checkpoints, resume and exports."""
    eval: TrainingEvalArgs = field(default_factory=TrainingEvalArgs)
    """lm-evaluation-harness tasks scored during training (scores logged as eval/<task>/<metric>)."""

    def check_settings(self) -> list[str]:
        """Check the eval schedule, the model and checkpoint sections, streaming, another tokenizer.

        A streamed dataset needs schedule.max_steps_per_epoch; a tokenizer read from another
        folder must fit the model's vocabulary.
        """
        problems = super().check_settings() + self.eval.check_settings()
        problems += self.model.check_settings() + self.checkpoint.check_settings()
        problems += _streaming_problems(
            self.dataset, self.val_dataset, self.schedule.max_steps_per_epoch
        )
        path = self.tokenizer.get("path") if isinstance(self.tokenizer, DictConfig) else None
        if isinstance(path, str) and path:
            problems += [
                f"key 'tokenizer.path': {problem}"
                for problem in tokenizer_fits_model(Path(path), Path(self.model.path))
            ]
        return problems


def _streaming_problems(dataset: Any, val_dataset: Any, max_steps_per_epoch: int | None) -> list:
    """A streamed dataset needs ``max_steps_per_epoch``; validation data cannot stream."""

    def streams(node: Any) -> bool:
        return isinstance(node, DictConfig) and node.get("streaming") is True

    problems = []
    if streams(dataset) and max_steps_per_epoch is None:
        problems.append(
            "key 'schedule.max_steps_per_epoch': dataset.streaming: true needs it (a stream's length is "
            "unknown, and the schedule and progress need the number of steps)"
        )
    if streams(val_dataset):
        problems.append("key 'val_dataset.streaming': validation data cannot stream")
    return problems


@dataclass(kw_only=True)
class FullFinetuneArgs(FinetuneArgs):
    """Settings of full_finetune_distributed."""

    model: SFTModelSetupArgs
    """The model: its folder, dtype, attention, compile, activation checkpointing and offloading, sharding."""
    parallelism: SFTParallelismArgs = field(default_factory=SFTParallelismArgs)
    """How the processes split the work (HSDP sizes, context parallelism, collective timeout)."""
    router: RouterArgs = field(default_factory=RouterArgs)
    """Mixture-of-experts router losses (dense models ignore them)."""


@dataclass(kw_only=True)
class LoRARecipeArgs(FinetuneArgs):
    """Settings shared by the LoRA recipes: the adapters, where they start, and a frozen base."""

    lora: LoRAArgs = field(default_factory=LoRAArgs)
    """The LoRA adapters."""
    adapter_dir: AdapterDir | None = None
    """Start from an existing PEFT adapter folder instead of a fresh adapter."""
    model: LoRAModelSetupArgs
    """The model: its folder, dtype, attention, compile, activation checkpointing, sharding, the frozen base."""
    parallelism: ModelParallelismArgs = field(default_factory=ModelParallelismArgs)
    """How the processes split the work (HSDP sizes, tensor and expert parallelism, collective timeout)."""

    def check_settings(self) -> list[str]:
        """The adapter's settings fill ``lora``; expert targets take no dropout nor DoRA.

        With ``adapter_dir`` the adapter decides the fields left at their defaults, and a
        conflicting field is a problem.
        """
        problems = super().check_settings()
        if self.lora is None:  # a recipe that allows full fine-tuning (GRPO's lora: null)
            if self.adapter_dir is not None:
                problems.append("key 'adapter_dir': an adapter needs lora settings (lora is null)")
            return problems
        # A folder without the file is already reported by adapter_dir's own check.
        if (
            self.adapter_dir is not None
            and (Path(self.adapter_dir) / ADAPTER_CONFIG_NAME).is_file()
        ):
            problems += self.lora.reconcile_with_adapter(self.adapter_dir)
        return problems + self.lora.expert_target_problems()


@dataclass(kw_only=True)
class LoRAFinetuneArgs(LoRARecipeArgs):
    """Settings of lora_finetune_distributed."""

    model: LoRASFTModelSetupArgs
    """The model: its folder, dtype, attention, compile, activation checkpointing and offloading, sharding, the frozen base."""
    parallelism: SFTParallelismArgs = field(default_factory=SFTParallelismArgs)
    """How the processes split the work (HSDP sizes, context parallelism, collective timeout)."""
    router: RouterArgs = field(default_factory=RouterArgs)
    """Mixture-of-experts router losses (dense models ignore them)."""


@dataclass(kw_only=True)
class GenerateArgs(RecipeArgs):
    """Settings of the generate recipe."""

    model: ModelFolderArgs
    """The model: a Hugging Face folder (a base model or an epoch_E export) and its dtype."""
    adapter_dir: AdapterDir | None = None
    """A PEFT adapter folder to apply on top of the model."""
    prompt: str = "Hello"
    """The user prompt (for instruct-style models, the instruction)."""
    input: str | None = None
    """Optional input joined to the prompt the way the template joins an instruct row's input."""
    template: Template | None = None
    """Template to wrap the prompt in (auto: the model's own chat template), or None for raw text."""
    max_new_tokens: AtLeastOne = 64
    """Tokens to generate at most."""
    temperature: Annotated[float, Finite(), Range(ge=0)] = 0.0
    """Sampling temperature (0: greedy)."""
    top_k: AtLeastOne | None = None
    """Sample only among the k most likely tokens."""
    seed: int = 0
    """Seed for sampling."""
    device: Literal["cpu", "cuda"] | None = None
    """Device (None: CUDA when available)."""


@dataclass(kw_only=True)
class EvalArgs(RecipeArgs):
    """Settings of the eval recipe: lm-evaluation-harness tasks on a model folder."""

    model: ModelFolderArgs
    """The model: a Hugging Face folder (a base model or an epoch_E export) and its dtype."""
    adapter_dir: AdapterDir | None = None
    """A PEFT adapter folder to apply on top of the model."""
    output_dir: Annotated[str, NonEmpty(), OutputDir()]
    """Folder for results.json (lm-eval's results) and, with log_samples, samples_<task>.jsonl."""
    tasks: Annotated[list[Annotated[str, NonEmpty()]], NonEmpty()]
    """lm-eval task registry names (arc_easy, hellaswag, mmlu), task YAML files, or folders of them."""
    num_fewshot: Annotated[int, Range(ge=0)] | None = None
    """Examples in each prompt (None: each task's own setting)."""
    limit: AtLeastOne | None = None
    """Documents per task at most (None: all); at least the number of processes."""
    batch_size: AtLeastOne = 8
    """Sequences per forward, per process (scoring and generation)."""
    max_length: AtLeastOne | None = None
    """Longest model input in tokens; longer ones lose tokens from the left (None: the model's max_position_embeddings)."""
    max_gen_toks: AtLeastOne = 256
    """Tokens a generation task generates at most when the task does not say."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (for instruct/chat models)."""
    log_samples: bool = False
    """Also write every document's prompts, responses and scores (samples_<task>.jsonl)."""
    seed: int = 0
    """Seed of lm-eval's few-shot sampling and of sampled generations."""
    device: Literal["cpu", "cuda"] | None = None
    """Device (None: CUDA when available)."""

    def check_settings(self) -> list[str]:
        """A task given as a path must be a task YAML file or a folder."""
        problems = super().check_settings()
        return problems + [
            f"key 'tasks': {problem}"
            for problem in map(task_path_problem, self.tasks or [])
            if problem is not None
        ]


@dataclass(kw_only=True)
class LoRADPOArgs(LoRARecipeArgs):
    """Settings of lora_dpo_distributed: LoRA preference tuning with the DPO family of losses."""

    dataset: Component = component(call_args=("tokenizer",))
    """The preference dataset (tunelab.data.preference_dataset); the recipe passes the tokenizer."""
    val_dataset: Component | None = component(required=False, call_args=("tokenizer",))
    """An optional preference dataset whose loss and rewards are logged with a val_ prefix."""
    loss: Component = component()
    """The preference loss (tunelab.losses.DPOLoss, IPOLoss, HingeLoss, SimPOLoss, ORPOLoss)."""
    adapter_dir: AdapterDir | None = None
    """An SFT adapter (PEFT folder) to start from; the reference is then base + this adapter, frozen."""
    reference_logps: Literal["live", "precompute"] = "live"
    """live: a reference forward per step; precompute: one pass over the dataset up front, none in steps."""


@dataclass(kw_only=True)
class LoRAKTOArgs(LoRARecipeArgs):
    """Settings of kto_distributed: LoRA KTO on unpaired completions labelled desirable or not."""

    dataset: Component = component(call_args=("tokenizer",))
    """The labelled completions (tunelab.data.kto_dataset); the recipe passes the tokenizer."""
    val_dataset: Component | None = component(required=False, call_args=("tokenizer",))
    """An optional kto_dataset whose loss, rewards and KL estimate are logged with a val_ prefix."""
    loss: Component = component(default="tunelab.losses.KTOLoss")
    """The unpaired preference loss (tunelab.losses.KTOLoss: beta, desirable_weight, undesirable_weight)."""
    adapter_dir: AdapterDir | None = None
    """An SFT adapter (PEFT folder) to start from; the reference is then base + this adapter, frozen."""
    reference_logps: Literal["live", "precompute"] = "live"
    """live: reference forwards every step; precompute: one pass over the dataset up front, none in steps."""


@dataclass(kw_only=True)
class GRPOArgs(LoRARecipeArgs):
    """Settings of grpo_distributed: online RL with verifiable rewards (GRPO, DAPO, Dr. GRPO, GSPO)."""

    lora: LoRAArgs | None = field(default_factory=LoRAArgs)
    """The LoRA adapters (the lora.* keys of lora_finetune_distributed); null: full fine-tuning (every weight trains; with loss.beta > 0 the reference is a frozen copy of the base)."""
    dataset: Component = component(call_args=("tokenizer",))
    """The prompt dataset (tunelab.data.prompt_dataset): a prompt per row, other columns for the rewards."""
    val_dataset: Component | None = component(required=False, call_args=("tokenizer",))
    """An optional prompt dataset (like dataset) scored with greedy completions every schedule.run_val_every_n_steps and at epoch ends: val_reward, val_rewards/<name>."""
    loss: Component = component(default="tunelab.rl.GRPOLoss")
    """The policy loss, a tunelab.rl.PolicyLoss: tunelab.rl.GRPOLoss (GRPO, DAPO, Dr. GRPO: clip_eps_low, clip_eps_high, beta, aggregation) or tunelab.rl.GSPOLoss (sequence-level ratio); left out: GRPOLoss's defaults."""
    rollout: RolloutArgs = field(default_factory=RolloutArgs)
    """The rollout phase: rollout.num_generations completions per prompt (the group), their lengths and sampling."""
    rewards: RewardArgs
    """The reward functions, their weights, time limit and scaling."""
    agentic: AgenticArgs | None = None
    """Agentic GRPO: each completion is an episode of turns with tool calls and environments (tunelab.rl.agentic); null: single-turn completions."""
    parallelism: ModelParallelismArgs = field(default_factory=ModelParallelismArgs)
    """How the processes split the work: HSDP sizes, collective timeout, and tensor parallelism of the trainers' update passes (with rollout.ranks > 0: the rollout ranks sample with the whole policy); expert parallelism is not built for GRPO yet."""

    def check_settings(self) -> list[str]:
        """The rollout and reward sections' checks, and prompt + completion within the context."""
        problems = super().check_settings()
        problems += self.rollout.check_settings() + self.rewards.check_settings()
        return problems + self._length_problems() + self._parallelism_problems()

    def _parallelism_problems(self) -> list[str]:
        """What tensor and expert parallelism do not cover in GRPO yet, one line each.

        Generation runs one forward per new token, as many as each process's completions need,
        and the rollout engine's KV cache is not split by heads: split matmuls or experts would
        pair up no collectives there. The update passes (log-probs, policy gradient) run under
        tensor parallelism, so the trainers can split their matmuls while rollout ranks
        (``rollout.ranks``) sample with the whole policy they are sent.
        """
        problems, parallelism = [], self.parallelism
        tensor, expert = parallelism.tensor_parallel_size, parallelism.expert_parallel_size
        if expert > 1:
            problems.append(
                f"key 'parallelism.expert_parallel_size': {expert} is not built for "
                "grpo_distributed yet (each process generates its own number of tokens, so its "
                "experts' all-to-alls would not pair up); use expert_parallel_size 1"
            )
        if tensor > 1 and self.rollout.ranks == 0:
            problems.append(
                f"key 'parallelism.tensor_parallel_size': {tensor} with rollouts sampled on the "
                "training processes is not built yet (generation does not run on split "
                "weights): set rollout.mode: async and rollout.ranks > 0, whose processes "
                "sample with the whole policy, or tensor_parallel_size 1"
            )
        if tensor > 1 and self.rollout.dynamic_sampling_refill_rounds:
            problems.append(
                f"key 'parallelism.tensor_parallel_size': {tensor} with "
                "rollout.dynamic_sampling_refill_rounds > 0 is not built yet (the rollout ranks "
                "would count a tp group's refills once per trainer): set it 0, or "
                "tensor_parallel_size 1"
            )
        if tensor > 1 and self.val_dataset is not None:
            problems.append(
                f"key 'parallelism.tensor_parallel_size': {tensor} with val_dataset is not "
                "built yet (validation generates on the training processes): remove "
                "val_dataset, or set tensor_parallel_size 1"
            )
        return problems

    def _length_problems(self) -> list[str]:
        """A prompt and its completion must fit the model's context (``max_position_embeddings``).

        Read from the model folder's ``config.json``; nothing to say when it cannot be read
        (the folder's own check reports that). A prompt takes at least one token, and a
        ``max_prompt_tokens`` given to a prompt dataset takes its whole length.
        """
        context = model_context_length(self.model.path)
        if context is None:
            return []
        where = f"max_position_embeddings {context} of {self.model.path}/config.json"
        # What follows a prompt: one completion, or a whole episode (replies, tool results).
        name, length = "rollout.max_new_tokens", self.rollout.max_new_tokens
        if self.agentic is not None:
            name, length = "agentic.max_episode_tokens", self.agentic.max_episode_tokens
        if length >= context:
            return [
                f"key '{name}': {length} tokens leave no room for a prompt in the model's "
                f"context ({where}); lower {name} below {context}"
            ]
        problems = []
        for key, node in (("dataset", self.dataset), ("val_dataset", self.val_dataset)):
            cap = node.get("max_prompt_tokens") if isinstance(node, DictConfig) else None
            if isinstance(cap, int) and not isinstance(cap, bool):
                if cap + length > context:
                    problems.append(
                        f"key '{key}.max_prompt_tokens': {cap} prompt tokens + {name} {length} = "
                        f"{cap + length} exceed the model's context ({where}); lower one of them "
                        f"(at most {context - length} prompt tokens with this {name})"
                    )
        return problems


@dataclass(kw_only=True)
class RewardModelArgs(LoRARecipeArgs):
    """Settings of reward_model_distributed: a Bradley-Terry reward model on preference pairs."""

    model: RewardModelSetupArgs
    """The model: its folder, dtype, attention, compile, activation checkpointing, sharding, the frozen base, and the score head's initialisation."""
    lora: LoRAArgs | None = field(default_factory=LoRAArgs)
    """The LoRA adapters (the score head trains whole beside them); null: full fine-tuning (every weight trains)."""
    dataset: Component = component(call_args=("tokenizer",))
    """The preference dataset (tunelab.data.preference_dataset; an optional margin column gives each pair its margin); the recipe passes the tokenizer."""
    val_dataset: Component | None = component(required=False, call_args=("tokenizer",))
    """An optional preference dataset whose loss, accuracy and margin are logged with a val_ prefix."""
    loss: Component = component(default="tunelab.losses.BradleyTerryLoss")
    """The reward-model loss, a tunelab.losses.PairwiseRewardLoss: tunelab.losses.BradleyTerryLoss (center_rewards_coefficient); left out: its defaults."""

    def check_settings(self) -> list[str]:
        """lm-eval tasks need a language-model head, which a reward model does not have."""
        problems = super().check_settings()
        if self.eval.tasks:
            problems.append(
                "key 'eval.tasks': a reward model (a sequence classifier) has no language-model "
                "head for lm-eval to score; remove eval.tasks (val_dataset gives val_accuracy)"
            )
        return problems
