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
from tunelab.config._model_dir import model_context_length, tokenizer_fits_model
from tunelab.config._tasks import task_path_problem
from tunelab.config.constraints import (
    ExistingPath,
    Finite,
    ModelDir,
    NonEmpty,
    OutputDir,
    Range,
)
from tunelab.config.lora import ADAPTER_CONFIG_NAME, LoRAArgs

AtLeastOne = Annotated[int, Range(ge=1)]
"""A count or interval that must be 1 or more."""
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


_NEEDS_CHECKPOINTING = (
    "key '{key}': it selects what activation checkpointing recomputes; set "
    "enable_activation_checkpointing: true"
)


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
    """Settings shared by the supervised fine-tuning recipes."""

    output_dir: Annotated[str, NonEmpty(), OutputDir()]
    """Folder for checkpoints (step_N/), exports (epoch_E/) and logs (logs/)."""
    output_dir_may_exist: bool = False
    """Let a first run write into a non-empty output_dir that tunelab did not make (tunelab never deletes or moves what it did not write there)."""
    checkpoint_dir: Annotated[str, NonEmpty(), ModelDir()]
    """The base model: a Hugging Face folder (config.json, safetensors, tokenizer files)."""
    seed: int = 0
    """Seed for initialisation, data order and dropout."""
    device: Literal["cpu", "cuda"] | None = None
    """Device to train on (None: CUDA when available)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter dtype."""
    mixed_precision: bool = False
    """Compute in bf16 with fp32 parameters and gradient reduction (FSDP2 MixedPrecisionPolicy)."""
    tokenizer: Component = component()
    """The tokenizer (tunelab.data.load_tokenizer)."""
    dataset: Component = component(call_args=("tokenizer",))
    """The training dataset; the recipe passes the tokenizer."""
    val_dataset: Component | None = component(required=False, call_args=("tokenizer",))
    """An optional validation dataset, evaluated every run_val_every_n_steps and at epoch ends."""
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
    batch_size: AtLeastOne = 2
    """Samples per micro-batch per process."""
    gradient_accumulation_steps: AtLeastOne = 1
    """Micro-batches per optimizer step."""
    allow_global_batch_change: bool = False
    """On resume with another number of processes, keep batch_size and gradient_accumulation_steps as configured even though the global batch (batch_size x gradient_accumulation_steps x processes) then differs from the checkpoint's; by default tunelab keeps the checkpoint's global batch, so the run is the uninterrupted one."""
    epochs: AtLeastOne = 1
    """Passes over the training data."""
    max_steps_per_epoch: AtLeastOne | None = None
    """Cap on optimizer steps per epoch (None: the whole dataset)."""
    clip_grad_norm: Annotated[float, Finite(), Range(gt=0)] | None = 1.0
    """Clip the global gradient norm to this value (None: no clipping)."""
    profile: bool = False
    """Record a few training steps with torch.profiler: one Chrome trace per rank in output_dir/profile/."""
    profile_skip_first: Annotated[int, Range(ge=0)] = 1
    """With profile: steps to run before recording (start-up and warm-up distort them)."""
    profile_record_steps: AtLeastOne = 3
    """With profile: steps to record."""
    skip_nonfinite_steps: Annotated[int, Range(ge=0)] = 0
    """Skip up to N steps whose loss or gradient norm is NaN/inf (no update); the next one stops the run."""
    log_every_n_steps: AtLeastOne = 1
    """Log metrics every N optimizer steps."""
    run_val_every_n_steps: AtLeastOne | None = None
    """Evaluate val_dataset every N optimizer steps (it is always evaluated at epoch ends)."""
    enable_activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward to save memory."""
    activation_checkpointing_every: AtLeastOne = 1
    """With enable_activation_checkpointing: checkpoint one block in this many (1: every block; k: about 1/k of them, less recompute and more memory)."""
    activation_checkpointing_scope: Literal["block", "attention"] = "block"
    """With enable_activation_checkpointing: recompute the whole block (keeps only its input) or only its attention (projections, rotary, attention; the feed-forward keeps its activations)."""
    offload_activations: bool = False
    """Keep the activations saved for backward in pinned host memory (torch.autograd.graph.save_on_cpu), copied back in backward: less GPU memory, more host traffic; CUDA only (on CPU a no-op, said in one line)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after each block's forward."""
    data_parallel_replicate_size: AtLeastOne = 1
    """HSDP: replicas of the model (across nodes); parameters are sharded within each (1: plain FSDP over all processes)."""
    data_parallel_shard_size: AtLeastOne | None = None
    """HSDP: processes each parameter is sharded over, usually the GPUs of one node (None: processes / data_parallel_replicate_size)."""
    context_parallel_size: AtLeastOne = 1
    """Context parallelism: consecutive processes that split every sequence (zig-zag), attention gathering keys and values among them; processes = data_parallel_replicate_size x data_parallel_shard_size x context_parallel_size, and FSDP shards parameters over shard x context ranks (1: off)."""
    collective_timeout_s: Annotated[float, Finite(), Range(gt=0)] = 1800.0
    """Seconds a collective waits for its peers before the worker fails (a hung peer becomes a torchrun restart, not an endless wait); long enough for a peer preparing data or finishing an export."""
    compile: bool = False
    """Compile each transformer block with torch.compile (measured on CPU, fp32, LoRA: 0.96-1.03x the uncompiled step after a long first step, so off by default; see docs/benchmarks.md)."""
    attention_backend: Literal["auto", "sdpa", "flex", "dense"] = "auto"
    """Attention kernel: sdpa (scaled_dot_product_attention, is_causal for unpacked rows, a mask for packed ones, GQA without repeating K/V), flex (flex_attention with a block mask built from the packed documents, no [seq, seq] tensor; CUDA only for training), dense (a [batch, seq, seq] mask and repeated K/V: the former path) or auto (flex on CUDA, sdpa on CPU)."""
    chunked_output: bool = True
    """Compute the logits chunk by chunk inside the loss (loss.num_chunks pieces), and only at scored positions (no logits for prompts or padding), so the [batch, seq, vocab] logits never exist whole, forward or backward (false: the whole logits, then the loss)."""
    router_aux_loss_coef: Annotated[float, Finite(), Range(ge=0)] | None = None
    """Mixture-of-experts models: weight of the router's load-balancing loss in the training loss (logged as router_aux_loss); null: the model's router_aux_loss_coef when its config.json sets output_router_logits: true (as transformers does), else 0. Dense models ignore it."""
    router_z_loss_coef: Annotated[float, Finite(), Range(ge=0)] = 0.0
    """Mixture-of-experts models: weight of the router z-loss, the mean over MoE layers and tokens of logsumexp(router logits)^2 (ST-MoE), in the training loss (logged as router_z_loss); 0: none. Dense models ignore it."""
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    """Intermediate checkpoints, resume and exports."""
    eval: TrainingEvalArgs = field(default_factory=TrainingEvalArgs)
    """lm-evaluation-harness tasks scored during training (scores logged as eval/<task>/<metric>)."""

    def check_settings(self) -> list[str]:
        """Check the eval schedule, checkpointing keys, streaming, and another tokenizer.

        The selective activation-checkpointing keys need checkpointing on; a streamed dataset
        needs max_steps_per_epoch; a tokenizer read from another folder must fit the model's
        vocabulary.
        """
        problems = super().check_settings() + self.eval.check_settings()
        if not self.enable_activation_checkpointing:
            if self.activation_checkpointing_every != 1:
                problems.append(_NEEDS_CHECKPOINTING.format(key="activation_checkpointing_every"))
            if self.activation_checkpointing_scope != "block":
                problems.append(_NEEDS_CHECKPOINTING.format(key="activation_checkpointing_scope"))
        problems += _streaming_problems(self.dataset, self.val_dataset, self.max_steps_per_epoch)
        path = self.tokenizer.get("path") if isinstance(self.tokenizer, DictConfig) else None
        if isinstance(path, str) and path:
            problems += [
                f"key 'tokenizer.path': {problem}"
                for problem in tokenizer_fits_model(Path(path), Path(self.checkpoint_dir))
            ]
        return problems


def _streaming_problems(dataset: Any, val_dataset: Any, max_steps_per_epoch: int | None) -> list:
    """A streamed dataset needs ``max_steps_per_epoch``; validation data cannot stream."""

    def streams(node: Any) -> bool:
        return isinstance(node, DictConfig) and node.get("streaming") is True

    problems = []
    if streams(dataset) and max_steps_per_epoch is None:
        problems.append(
            "key 'max_steps_per_epoch': dataset.streaming: true needs it (a stream's length is "
            "unknown, and the schedule and progress need the number of steps)"
        )
    if streams(val_dataset):
        problems.append("key 'val_dataset.streaming': validation data cannot stream")
    return problems


@dataclass(kw_only=True)
class FullFinetuneArgs(FinetuneArgs):
    """Settings of full_finetune_distributed."""


@dataclass(kw_only=True)
class LoRAFinetuneArgs(FinetuneArgs):
    """Settings of lora_finetune_distributed."""

    lora: LoRAArgs = field(default_factory=LoRAArgs)
    """The LoRA adapters."""
    adapter_dir: AdapterDir | None = None
    """Start from an existing PEFT adapter folder instead of a fresh adapter."""
    frozen_base: Literal["auto", "replicate", "shard"] = "auto"
    """With several processes: replicate keeps the frozen base gathered on every rank after the first step (no all-gather per step; the full base in memory), shard re-gathers it every forward and backward; auto replicates when it fits the memory budget (logged)."""

    def check_settings(self) -> list[str]:
        """The adapter's settings fill ``lora``; expert targets take no dropout nor DoRA.

        With ``adapter_dir`` the adapter decides the fields left at their defaults, and a
        conflicting field is a problem.
        """
        problems = super().check_settings()
        # A folder without the file is already reported by adapter_dir's own check.
        if (
            self.adapter_dir is not None
            and (Path(self.adapter_dir) / ADAPTER_CONFIG_NAME).is_file()
        ):
            problems += self.lora.reconcile_with_adapter(self.adapter_dir)
        return problems + self.lora.expert_target_problems()


@dataclass(kw_only=True)
class GenerateArgs(RecipeArgs):
    """Settings of the generate recipe."""

    checkpoint_dir: Annotated[str, NonEmpty(), ModelDir()]
    """A Hugging Face model folder (a base model or an epoch_E export)."""
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
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Model dtype."""


@dataclass(kw_only=True)
class EvalArgs(RecipeArgs):
    """Settings of the eval recipe: lm-evaluation-harness tasks on a model folder."""

    checkpoint_dir: Annotated[str, NonEmpty(), ModelDir()]
    """A Hugging Face model folder (a base model or an epoch_E export)."""
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
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Model dtype."""

    def check_settings(self) -> list[str]:
        """A task given as a path must be a task YAML file or a folder."""
        problems = super().check_settings()
        return problems + [
            f"key 'tasks': {problem}"
            for problem in map(task_path_problem, self.tasks or [])
            if problem is not None
        ]


_NO_ROUTER_LOSS = (
    "key 'router_aux_loss_coef': {recipe} does not add a router load-balancing loss yet "
    "(the SFT recipes do): leave it null or 0"
)
_NO_Z_LOSS = (
    "key 'router_z_loss_coef': {recipe} does not add a router z-loss yet (the SFT recipes do): "
    "leave it 0"
)


_NO_CONTEXT_PARALLEL = (
    "key 'context_parallel_size': {recipe} does not split sequences yet (the SFT recipes "
    "do): leave it 1"
)

_NO_OFFLOAD = (
    "key 'offload_activations': {recipe} does not offload activations yet (the SFT recipes "
    "do): leave it false"
)


@dataclass(kw_only=True)
class LoRADPOArgs(LoRAFinetuneArgs):
    """Settings of lora_dpo_distributed: LoRA preference tuning with the DPO family of losses."""

    dataset: Component = component(call_args=("tokenizer",))
    """The preference dataset (tunelab.data.preference_dataset); the recipe passes the tokenizer."""
    val_dataset: Component | None = component(required=False, call_args=("tokenizer",))
    """An optional preference dataset whose loss and rewards are logged with a val_ prefix."""
    loss: Component = component()
    """The preference loss (tunelab.losses.DPOLoss, IPOLoss, HingeLoss, SimPOLoss)."""
    batch_size: AtLeastOne = 2
    """Preference pairs per micro-batch per process (the forward sees twice as many rows)."""
    adapter_dir: AdapterDir | None = None
    """An SFT adapter (PEFT folder) to start from; the reference is then base + this adapter, frozen."""
    reference_logps: Literal["live", "precompute"] = "live"
    """live: a reference forward per step; precompute: one pass over the dataset up front, none in steps."""

    def check_settings(self) -> list[str]:
        """The adapter checks, and no router loss weight (this recipe does not add it yet)."""
        problems = super().check_settings()
        if self.router_aux_loss_coef:
            problems.append(_NO_ROUTER_LOSS.format(recipe="lora_dpo_distributed"))
        if self.context_parallel_size != 1:
            problems.append(_NO_CONTEXT_PARALLEL.format(recipe="lora_dpo_distributed"))
        if self.offload_activations:
            problems.append(_NO_OFFLOAD.format(recipe="lora_dpo_distributed"))
        if self.router_z_loss_coef:
            problems.append(_NO_Z_LOSS.format(recipe="lora_dpo_distributed"))
        return problems


@dataclass(kw_only=True)
class GRPOArgs(LoRAFinetuneArgs):
    """Settings of grpo_distributed: online RL with verifiable rewards (GRPO, DAPO, Dr. GRPO)."""

    lora: LoRAArgs | None = field(default_factory=LoRAArgs)
    """The LoRA adapters (the lora.* keys of lora_finetune_distributed); null: full fine-tuning (every weight trains; with loss.beta > 0 the reference is a frozen copy of the base)."""
    dataset: Component = component(call_args=("tokenizer",))
    """The prompt dataset (tunelab.data.prompt_dataset): a prompt per row, other columns for the rewards."""
    val_dataset: Component | None = component(required=False, call_args=("tokenizer",))
    """An optional prompt dataset (like dataset) scored with greedy completions every run_val_every_n_steps and at epoch ends: val_reward, val_rewards/<name>."""
    loss: Component = component(default="tunelab.rl.GRPOLoss")
    """The policy loss, a tunelab.rl.PolicyLoss: tunelab.rl.GRPOLoss (GRPO, DAPO, Dr. GRPO: clip_eps_low, clip_eps_high, beta, aggregation) or tunelab.rl.GSPOLoss (sequence-level ratio); left out: GRPOLoss's defaults."""
    rewards: list[Component] = component(call_args=("prompts", "completions", "rows"))
    """Reward functions (prompts, completions, rows, **settings) -> list[float], summed with reward_weights."""
    reward_weights: list[Annotated[float, Finite()]] | None = None
    """One weight per reward (None: all 1.0)."""
    batch_size: AtLeastOne = 2
    """Prompts per micro-batch per process (each sampled num_generations times)."""
    num_generations: Annotated[int, Range(ge=2)] = 4
    """Completions sampled per prompt (the group size G)."""
    max_new_tokens: AtLeastOne = 32
    """Tokens a completion has at most (also Dr. GRPO's constant length); a prompt and its completion must fit the model's max_position_embeddings."""
    temperature: Annotated[float, Finite(), Range(ge=0)] = 1.0
    """Sampling temperature, above 0 (0 is greedy: every completion of a group would be the same, so nothing trains; refused)."""
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Nucleus sampling: keep the most likely tokens up to this probability (1: all)."""
    top_k: AtLeastOne | None = None
    """Sample only among the k most likely tokens (None: all)."""
    stop_strings: list[Annotated[str, NonEmpty()]] | None = None
    """Texts that end a completion (besides the tokenizer's stop tokens), e.g. ["</answer>"]."""
    num_iterations: AtLeastOne = 1
    """Optimizer steps per batch of rollouts (>1 reuses them with the sampling policy's stored log-probs)."""
    scale_rewards: bool = True
    """Divide each group's centred rewards by its std (GRPO, DAPO); false for Dr. GRPO."""
    dynamic_sampling: bool = False
    """Leave out of the loss the groups whose rewards are all equal (DAPO's dynamic sampling; see dynamic_sampling_refill_rounds)."""
    dynamic_sampling_refill_rounds: Annotated[int, Range(ge=0)] = 0
    """With dynamic_sampling: up to N rounds of batch_size more prompts per process, sampled until the step has as many kept groups as its own prompts (0: no refill, the step trains on the groups left)."""
    rollout_gather_once: bool = True
    """FSDP2: all-gather the sharded weights once per rollout phase and hold them until its last token (each process then holds the whole model while generating); false: gather block by block for every generated token (less memory, one all-gather per block per token)."""
    reward_timeout_s: Annotated[float, Finite(), Range(gt=0)] | None = 60.0
    """Seconds one reward call may take to score a micro-batch's completions; past it the run ends with one line naming the reward and the rank (None: no limit, a hung reward then waits out collective_timeout_s)."""
    rollout_merge_adapters: bool = True
    """LoRA/DoRA: the rollout phase runs each adapter merged into a temporary copy of its weight, W + scale * B A (one linear per projection instead of three; the live weights untouched); costs a copy of the adapted weights while generating, and tokens may differ from the unmerged path's by rounding. Not for an NF4 base (QLoRA keeps it unmerged), nor under FSDP2 with rollout_gather_once false (the weights are never whole)."""

    def check_settings(self) -> list[str]:
        """The settings grpo_distributed does not use must be left out."""
        if self.lora is None:  # full fine-tuning: no adapter to reconcile
            problems = FinetuneArgs.check_settings(self)
            if self.adapter_dir is not None:
                problems.append("key 'adapter_dir': an adapter needs lora settings (lora is null)")
        else:
            problems = super().check_settings()
        if self.router_aux_loss_coef:
            problems.append(_NO_ROUTER_LOSS.format(recipe="grpo_distributed"))
        if self.context_parallel_size != 1:
            problems.append(_NO_CONTEXT_PARALLEL.format(recipe="grpo_distributed"))
        if self.offload_activations:
            problems.append(_NO_OFFLOAD.format(recipe="grpo_distributed"))
        if self.router_z_loss_coef:
            problems.append(_NO_Z_LOSS.format(recipe="grpo_distributed"))
        if self.dynamic_sampling_refill_rounds and not self.dynamic_sampling:
            problems.append(
                "key 'dynamic_sampling_refill_rounds': refills replace the groups dynamic sampling leaves out; set dynamic_sampling: true or leave it 0"
            )
        if not self.rewards:
            problems.append(
                "key 'rewards': give at least one reward function (a list of nodes with "
                "_component_, e.g. tunelab.rl.regex_reward)"
            )
        problems += self._length_problems()
        if self.temperature == 0:
            problems.append(
                f"key 'temperature': 0 samples greedily, so the num_generations="
                f"{self.num_generations} completions of a prompt are the same tokens with the "
                "same reward: every advantage is 0 and every loss and gradient 0.0, nothing "
                "trains; set temperature > 0 (1.0 samples the policy as it is)"
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards or []):
            problems.append(
                f"key 'reward_weights': {len(self.reward_weights)} weights for {len(self.rewards or [])} rewards; give one each"
            )
        return problems

    def _length_problems(self) -> list[str]:
        """A prompt and its completion must fit the model's context (``max_position_embeddings``).

        Read from the model folder's ``config.json``; nothing to say when it cannot be read
        (the folder's own check reports that). A prompt takes at least one token, and a
        ``max_prompt_tokens`` given to a prompt dataset takes its whole length.
        """
        context = model_context_length(self.checkpoint_dir)
        if context is None:
            return []
        where = f"max_position_embeddings {context} of {self.checkpoint_dir}/config.json"
        if self.max_new_tokens >= context:
            return [
                f"key 'max_new_tokens': {self.max_new_tokens} tokens leave no room for a prompt "
                f"in the model's context ({where}); lower max_new_tokens below {context}"
            ]
        problems = []
        for key, node in (("dataset", self.dataset), ("val_dataset", self.val_dataset)):
            cap = node.get("max_prompt_tokens") if isinstance(node, DictConfig) else None
            if isinstance(cap, int) and not isinstance(cap, bool):
                if cap + self.max_new_tokens > context:
                    problems.append(
                        f"key '{key}.max_prompt_tokens': {cap} prompt tokens + max_new_tokens "
                        f"{self.max_new_tokens} = {cap + self.max_new_tokens} exceed the model's "
                        f"context ({where}); lower one of them (at most "
                        f"{context - self.max_new_tokens} prompt tokens with this "
                        "max_new_tokens)"
                    )
        return problems
