"""The typed sections of a recipe's settings: one per concern, each handed whole to its owner.

A recipe's record (``recipe_args``) composes the sections it uses, so a setting a recipe does
not support is simply not there (strict validation names the closest known key). Each section
is read by one owner: ``model`` by ``build_model``, ``parallelism`` by ``init_distributed`` and
``data_parallel_mesh``, ``schedule`` by ``build_data``/``Schedule``/``OptimizerStep``,
``profile`` by ``StepProfiler``, ``router`` by ``RouterLoss``, ``rollout`` by GRPO's rollout
phase, ``rewards`` by ``Rewards``. A new setting is a field here and one use in its owner.

This module must not import torch: ``tunelab validate`` imports it to check a config.
"""

from dataclasses import dataclass
from typing import Annotated, Literal

from tunelab.config._args import Component, component
from tunelab.config.constraints import Finite, ModelDir, NonEmpty, Range

AtLeastOne = Annotated[int, Range(ge=1)]
"""A count or interval that must be 1 or more."""


@dataclass(kw_only=True)
class ModelFolderArgs:
    """The model a recipe loads: its Hugging Face folder and parameter dtype."""

    path: Annotated[str, NonEmpty(), ModelDir()]
    """The base model: a Hugging Face folder (config.json, safetensors, tokenizer files), or an epoch_E export."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter dtype."""


@dataclass(kw_only=True)
class ModelSetupArgs(ModelFolderArgs):
    """The model: where it comes from, and how it is built, placed and run."""

    mixed_precision: bool = False
    """Compute in bf16 with fp32 parameters and gradient reduction (FSDP2 MixedPrecisionPolicy)."""
    attention_backend: Literal["auto", "sdpa", "flex", "dense"] = "auto"
    """Attention kernel: sdpa (scaled_dot_product_attention, is_causal for unpacked rows, a mask for packed ones, GQA without repeating K/V), flex (flex_attention with a block mask built from the packed documents, no [seq, seq] tensor; CUDA only for training), dense (a [batch, seq, seq] mask and repeated K/V: the former path) or auto (flex on CUDA, sdpa on CPU)."""
    compile: bool = False
    """Compile each transformer block with torch.compile (measured on CPU, fp32, LoRA: 0.96-1.03x the uncompiled step after a long first step, so off by default; see docs/benchmarks.md)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward to save memory."""
    activation_checkpointing_every: AtLeastOne = 1
    """With activation_checkpointing: checkpoint one block in this many (1: every block; k: about 1/k of them, less recompute and more memory)."""
    activation_checkpointing_scope: Literal["block", "attention"] = "block"
    """With activation_checkpointing: recompute the whole block (keeps only its input) or only its attention (projections, rotary, attention; the feed-forward keeps its activations)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after each block's forward."""
    chunked_output: bool = True
    """Compute the logits chunk by chunk inside the loss (loss.num_chunks pieces), and only at scored positions (no logits for prompts or padding), so the [batch, seq, vocab] logits never exist whole, forward or backward (false: the whole logits, then the loss)."""
    trim_last_layer: bool = True
    """With chunked_output: the last decoder layer runs past attention (o_proj, norms, MLP) at the scored positions only, as the output layer does; equal to the full forward up to fp32 rounding (false: every position, as tensor and context parallelism, a router loss and LoRA dropout in the last layer always do; compare such layouts with it off)."""

    def check_settings(self) -> list[str]:
        """The selective activation-checkpointing keys need checkpointing on."""
        problems = []
        if not self.activation_checkpointing:
            for key, value, default in (
                ("activation_checkpointing_every", self.activation_checkpointing_every, 1),
                ("activation_checkpointing_scope", self.activation_checkpointing_scope, "block"),
            ):
                if value != default:
                    problems.append(
                        f"key 'model.{key}': it selects what activation checkpointing "
                        "recomputes; set model.activation_checkpointing: true"
                    )
        return problems


@dataclass(kw_only=True)
class LoRAModelSetupArgs(ModelSetupArgs):
    """The model of a LoRA recipe: a frozen base under the adapters."""

    frozen_base: Literal["auto", "replicate", "shard"] = "auto"
    """With several processes: replicate keeps the frozen base gathered on every rank after the first step (no all-gather per step; the full base in memory), shard re-gathers it every forward and backward; auto replicates when it fits the memory budget (logged)."""
    vision_tower: Literal["frozen", "lora"] = "frozen"
    """A vision-language model's vision tower (patch embedding, position table and blocks): frozen, or lora (every linear layer of its blocks adapted, whatever lora.targets says; the patch embedding stays frozen)."""
    projector: Literal["frozen", "lora"] = "frozen"
    """A vision-language model's projector (the patch merger into the language model, and Qwen3-VL's deepstack mergers): frozen, or lora (their linear layers adapted)."""


@dataclass(kw_only=True)
class RewardModelSetupArgs(LoRAModelSetupArgs):
    """The model of the reward-model recipe: the decoder with a scalar ``score`` head on its last token."""

    score_init_std: Annotated[float, Finite(), Range(ge=0)] = 0.02
    """Standard deviation of the normal initialisation of a fresh score head (transformers' initializer_range); a folder that has score.weight (a reward-model export) loads it instead."""


@dataclass(kw_only=True)
class SFTModelSetupArgs(ModelSetupArgs):
    """The model of the full fine-tuning recipe, which can offload activations."""

    vision_tower: Literal["frozen", "full"] = "full"
    """A vision-language model's vision tower (patch embedding, position table and blocks): full (trained) or frozen."""
    projector: Literal["frozen", "full"] = "full"
    """A vision-language model's projector (the patch merger into the language model, and Qwen3-VL's deepstack mergers): full (trained) or frozen."""

    offload_activations: bool = False
    """Keep the activations saved for backward in pinned host memory (torch.autograd.graph.save_on_cpu), copied back in backward: less GPU memory, more host traffic; CUDA only (on CPU a no-op, said in one line)."""


@dataclass(kw_only=True)
class LoRASFTModelSetupArgs(LoRAModelSetupArgs):
    """The model of the LoRA fine-tuning recipe: a frozen base, and activations it can offload."""

    # The supervised LoRA recipe can also train a part whole; the preference and RL recipes
    # cannot (their reference is the base with the adapters off, which a trained part changes).
    vision_tower: Literal["frozen", "lora", "full"] = "frozen"
    """A vision-language model's vision tower (patch embedding, position table and blocks): frozen, lora (every linear layer of its blocks adapted, whatever lora.targets says; the patch embedding stays frozen), or full (every weight trained beside the adapters; the adapter export carries them as PEFT's modules_to_save)."""
    projector: Literal["frozen", "lora", "full"] = "frozen"
    """A vision-language model's projector (the patch merger into the language model, and Qwen3-VL's deepstack mergers): frozen, lora (their linear layers adapted) or full (trained whole, as for vision_tower)."""

    offload_activations: bool = False
    """Keep the activations saved for backward in pinned host memory (torch.autograd.graph.save_on_cpu), copied back in backward: less GPU memory, more host traffic; CUDA only (on CPU a no-op, said in one line)."""


@dataclass(kw_only=True)
class ParallelismArgs:
    """How the processes split the work: data-parallel replicas and shards, and timeouts."""

    data_parallel_replicate_size: AtLeastOne = 1
    """HSDP: replicas of the model (across nodes); parameters are sharded within each (1: plain FSDP over all processes)."""
    data_parallel_shard_size: AtLeastOne | None = None
    """HSDP: processes each parameter is sharded over, usually the GPUs of one node (None: processes / data_parallel_replicate_size)."""
    collective_timeout_s: Annotated[float, Finite(), Range(gt=0)] = 1800.0
    """Seconds a collective waits for its peers before the worker fails (a hung peer becomes a torchrun restart, not an endless wait); long enough for a peer preparing data or finishing an export."""

    # The sizes of the context-, expert- and tensor-parallel groups: class attributes (not
    # settings) for the recipes that do not split sequences, experts or matmuls, so the mesh
    # code reads one name either way.
    context_parallel_size = 1
    expert_parallel_size = 1
    tensor_parallel_size = 1

    @property
    def ranks_per_sample(self) -> int:
        """Consecutive processes that see the same samples (context- and tensor-parallel ranks)."""
        return self.context_parallel_size * self.tensor_parallel_size


@dataclass(kw_only=True)
class ModelParallelismArgs(ParallelismArgs):
    """Parallelism of the recipes that can also split the model's matmuls and experts."""

    expert_parallel_size: AtLeastOne = 1
    """Expert parallelism: consecutive processes each MoE layer's experts are split over, whole experts each, tokens sent to them by all-to-all instead of gathering the experts; it must divide the processes and the experts, and processes / expert_parallel_size groups then hold the same experts, their gradients summed (1: off). The other weights stay FSDP's or HSDP's; with tensor_parallel_size > 1 it must be a multiple of it (attention split by heads, each rank's part of the sequence routed to the experts)."""
    tensor_parallel_size: AtLeastOne = 1
    """Tensor parallelism: consecutive processes (usually the GPUs of one node) that split every attention and MLP matmul and the vocabulary (sequence-parallel norms between them); processes = data_parallel_replicate_size x data_parallel_shard_size x context_parallel_size x tensor_parallel_size (1: off; with context parallelism each cp slice of a row is split again over the tp ranks). A mixture-of-experts model needs expert_parallel_size too: its experts are not split by tensor parallelism."""


@dataclass(kw_only=True)
class SFTParallelismArgs(ModelParallelismArgs):
    """Parallelism of the supervised recipes, which can also split sequences."""

    context_parallel_size: AtLeastOne = 1
    """Context parallelism: consecutive processes that split every sequence (zig-zag), attention gathering keys and values among them; processes = data_parallel_replicate_size x data_parallel_shard_size x context_parallel_size x tensor_parallel_size, and FSDP shards parameters over shard x context ranks (1: off; with tensor_parallel_size the tp ranks are innermost and a cp group is the ranks of one tp index)."""


@dataclass(kw_only=True)
class ScheduleArgs:
    """How long the run trains, in what batches, and how often it logs and validates."""

    epochs: AtLeastOne = 1
    """Passes over the training data."""
    batch_size: AtLeastOne = 2
    """Samples per micro-batch per process (DPO: preference pairs, the forward sees twice as many rows; GRPO: prompts, each sampled rollout.num_generations times)."""
    gradient_accumulation_steps: AtLeastOne = 1
    """Micro-batches per optimizer step."""
    allow_global_batch_change: bool = False
    """On resume with another number of processes, keep batch_size and gradient_accumulation_steps as configured even though the global batch (batch_size x gradient_accumulation_steps x processes) then differs from the checkpoint's; by default tunelab keeps the checkpoint's global batch, so the run is the uninterrupted one."""
    max_steps_per_epoch: AtLeastOne | None = None
    """Cap on optimizer steps per epoch (None: the whole dataset)."""
    dataloader_workers: Annotated[int, Range(ge=0)] = 0
    """Worker processes per process that collate the batches (read and preprocess a batch's images, pad its tokens) ahead of the step; 0: in the training process. The batches are the same whatever the number, in the same order, and a resume continues them exactly (a stream, dataset.streaming, has its own: dataset.num_proc)."""
    clip_grad_norm: Annotated[float, Finite(), Range(gt=0)] | None = 1.0
    """Clip the global gradient norm to this value (None: no clipping)."""
    skip_nonfinite_steps: Annotated[int, Range(ge=0)] = 0
    """Skip up to N steps whose loss or gradient norm is NaN/inf (no update); the next one stops the run."""
    log_every_n_steps: AtLeastOne = 1
    """Log metrics every N optimizer steps."""
    run_val_every_n_steps: AtLeastOne | None = None
    """Evaluate val_dataset every N optimizer steps (it is always evaluated at epoch ends)."""


@dataclass(kw_only=True)
class ProfileArgs:
    """torch.profiler traces of a few training steps."""

    enabled: bool = False
    """Record a few training steps with torch.profiler: one Chrome trace per rank in output_dir/profile/."""
    skip_first: Annotated[int, Range(ge=0)] = 1
    """Steps to run before recording (start-up and warm-up distort them)."""
    record_steps: AtLeastOne = 3
    """Steps to record."""


@dataclass(kw_only=True)
class RouterArgs:
    """Mixture-of-experts router losses added to the training loss (dense models ignore them)."""

    aux_loss_coef: Annotated[float, Finite(), Range(ge=0)] | None = None
    """Weight of the router's load-balancing loss in the training loss (logged as router_aux_loss); null: the model's router_aux_loss_coef when its config.json sets output_router_logits: true (as transformers does), else 0."""
    z_loss_coef: Annotated[float, Finite(), Range(ge=0)] = 0.0
    """Weight of the router z-loss, the mean over MoE layers and tokens of logsumexp(router logits)^2 (ST-MoE), in the training loss (logged as router_z_loss); 0: none."""


@dataclass(kw_only=True)
class RolloutArgs:
    """GRPO's rollout phase: the group of completions sampled per prompt, and how."""

    num_generations: Annotated[int, Range(ge=2)] = 4
    """Completions sampled per prompt: the group size, whose rewards are centred (and scaled) together."""
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
    dynamic_sampling: bool = False
    """Leave out of the loss the groups whose rewards are all equal (DAPO's dynamic sampling; see dynamic_sampling_refill_rounds)."""
    dynamic_sampling_refill_rounds: Annotated[int, Range(ge=0)] = 0
    """With dynamic_sampling: up to N rounds of schedule.batch_size more prompts per process, sampled until the step has as many kept groups as its own prompts (0: no refill, the step trains on the groups left)."""
    gather_once: bool = True
    """FSDP2: all-gather the sharded weights once per rollout phase and hold them until its last token (each process then holds the whole model while generating); false: gather block by block for every generated token (less memory, one all-gather per block per token)."""
    merge_adapters: bool = True
    """LoRA/DoRA: the rollout phase runs each adapter merged into a temporary copy of its weight, W + scale * B A (one linear per projection instead of three; the live weights untouched); costs a copy of the adapted weights while generating, and tokens may differ from the unmerged path's by rounding. Not for an NF4 base (QLoRA keeps it unmerged), nor under FSDP2 with gather_once false (the weights are never whole)."""
    compile: bool = False
    """torch.compile the decode step (inductor on CPU, CUDA graphs on CUDA), once per shape bucket; tokens equal the eager step's; a failed compile decodes eagerly with one logged line. Off by default: compiling takes minutes on a small CPU, for 1.04x (768-wide model) to 1.36x (tiny) faster decode steps there."""
    mode: Literal["sync", "async"] = "sync"
    """sync: each step trains on completions its own policy sampled; async: the batch of step s is sampled by the policy of step s - max_lag (a fixed pipeline depth within an epoch, so the schedule depends on the step and max_lag only; the batches in flight go into step checkpoints) and corrected with off_policy; agentic episodes too (colocated, with overlap, or on rollout ranks)."""
    max_lag: Annotated[int, Range(ge=0)] = 1
    """mode async: policy updates between the policy that samples a batch and the update that trains on it (0: synchronous GRPO, bit for bit)."""
    off_policy: Component = component(default="tunelab.rl.TruncatedIS")
    """mode async: the importance weight on each token loss of a batch sampled by an older policy, a tunelab.rl.OffPolicyCorrection: tunelab.rl.TruncatedIS (cap) or tunelab.rl.MaskedIS (low, high)."""
    ranks: Annotated[int, Range(ge=0)] = 0
    """mode async: the last N processes of the job only sample (rollout ranks) and the others only train, on batches the rollout ranks sampled with the policy max_lag updates older (each trainer sends its shards right after each update, in the background: LoRA the adapter, full every weight); the same schedule and results as the colocated run with as many trainers, refill rounds included (0: every process samples and trains). Needs at least N trainers; a checkpoint resumes with any rollout.ranks and as many trainers. With an agentic section a rollout rank rolls out whole episodes (tools run on it)."""
    overlap: bool = False
    """mode async with ranks 0 (colocated): each process keeps a whole, unsharded copy of the model and samples the next batches on it in a worker thread while the step trains (the policy copied over in one all-gather per sampled batch); the same completions, metrics and checkpoints as without it. Costs a second copy of the model per process; not with dynamic_sampling_refill_rounds (their rounds agree over a collective). With an agentic section the thread rolls out whole episodes (tools included)."""

    def check_settings(self) -> list[str]:
        """Refills need dynamic sampling; greedy sampling trains nothing; max_lag and overlap need async."""
        problems = []
        if self.dynamic_sampling_refill_rounds and not self.dynamic_sampling:
            problems.append(
                "key 'rollout.dynamic_sampling_refill_rounds': refills replace the groups "
                "dynamic sampling leaves out; set rollout.dynamic_sampling: true or leave it 0"
            )
        if self.temperature == 0:
            problems.append(
                f"key 'rollout.temperature': 0 samples greedily, so the rollout.num_generations="
                f"{self.num_generations} completions of a prompt are the same tokens with the "
                "same reward: every advantage is 0 and every loss and gradient 0.0, nothing "
                "trains; set temperature > 0 (1.0 samples the policy as it is)"
            )
        if self.ranks and self.mode == "sync":
            problems.append(
                f"key 'rollout.ranks': {self.ranks} rollout ranks sample ahead of training: "
                "set rollout.mode: async, or leave rollout.ranks 0"
            )
        if self.overlap and (self.mode == "sync" or self.ranks):
            problems.append(
                "key 'rollout.overlap': samples on a worker thread beside training in the "
                "colocated asynchronous run; set rollout.mode: async and rollout.ranks: 0 (split "
                "ranks overlap already)"
            )
        if self.overlap and self.dynamic_sampling_refill_rounds:
            problems.append(
                "key 'rollout.overlap': refill rounds agree over a collective, which the "
                "sampling thread does not run; set rollout.dynamic_sampling_refill_rounds: 0 "
                "or rollout.overlap: false"
            )
        if self.mode == "sync" and self.max_lag != 1:
            problems.append(
                f"key 'rollout.max_lag': {self.max_lag} is read only with rollout.mode: async "
                "(sync samples every batch with the policy it trains); set rollout.mode: async"
            )
        return problems


@dataclass(kw_only=True)
class RewardArgs:
    """GRPO's rewards: the functions, their weights, their time limit and the scaling."""

    functions: list[Component] = component(call_args=("prompts", "completions", "rows"))
    """Reward functions (prompts, completions, rows, **settings) -> list[float], summed with weights."""
    weights: list[Annotated[float, Finite()]] | None = None
    """One weight per reward function (None: all 1.0)."""
    timeout_s: Annotated[float, Finite(), Range(gt=0)] | None = 60.0
    """Seconds one reward call may take to score a micro-batch's completions; past it the run ends with one line naming the reward and the rank (None: no limit, a hung reward then waits out parallelism.collective_timeout_s)."""
    scale: bool = True
    """Divide each group's centred rewards by its std (GRPO, DAPO); false for Dr. GRPO."""

    def check_settings(self) -> list[str]:
        """At least one function, and one weight each."""
        problems = []
        if not self.functions:
            problems.append(
                "key 'rewards.functions': give at least one reward function (a list of nodes "
                "with _component_, e.g. tunelab.rl.regex_reward)"
            )
        if self.weights is not None and len(self.weights) != len(self.functions or []):
            problems.append(
                f"key 'rewards.weights': {len(self.weights)} weights for "
                f"{len(self.functions or [])} reward functions; give one each"
            )
        return problems
