"""Online RL with verifiable rewards (GRPO, DAPO, Dr. GRPO) of a decoder LLM, LoRA or full, 1..N processes.

Launch: ``tunelab run --nproc_per_node 2 grpo_distributed --config tiny/grpo``.
Copy it to customise: ``tunelab cp grpo_distributed my_grpo.py``.

Each step: 1. take this rank's prompts and sample ``rollout.num_generations`` completions of each
with the training model (``ModelRolloutEngine``: batched, KV cache, a seed per completion),
score them with the configured rewards and turn each group's rewards into advantages
(``GroupSampler``; with dynamic sampling, groups of equal rewards are left out and may be
refilled from more prompts); 2. store the reference's log-probs when needed; 3.
``rollout.num_iterations`` optimizer steps over the rollouts with the configured policy loss
(``loss:``, a ``tunelab.rl.PolicyLoss``: ``GRPOLoss`` by default, or ``GSPOLoss``), the
log-probs computed at completion positions only (the first pass's, taken before any update,
are the sampling policy's: kept for the next passes); 4.
``after_step`` logs, validates (greedy completions of ``val_dataset``), exports and saves.
The reference (``loss.beta`` > 0) is the model with its adapters disabled, or for full fine-tuning
(``lora: null``) a frozen copy of the base. Sampling seeds derive from the seed, the step and
the prompt's index, so a resumed run or another number of processes samples the same
completions. With ``rollout.mode: async`` step ``s`` trains on a batch the policy of step
``s - rollout.max_lag`` sampled (``RolloutPipeline``: a fixed depth, the batches in flight in
every checkpoint), its token losses weighed by ``rollout.off_policy`` (truncated importance
sampling by default) against the log-probs recorded while sampling. With ``rollout.ranks`` N > 0
the last N processes only sample (``rollout_rank``) and the others only train, on what they
sampled: the same schedule, the policy sent to them right after each update by a background
thread, each trainer its own shards (``RemoteRollouts``); a stop signal stops them after the
trainers' checkpoint. With ``rollout.overlap`` (colocated async) a worker thread samples the
next batches on a whole copy of the model while each step trains (``ThreadRollouts``).
With an ``agentic`` section each completion is an episode of turns with tool calls
(``EpisodeGroupSampler``), in every one of these modes: colocated, on the worker thread and on
rollout ranks, each of which rolls out whole episodes (tools included) on its whole copy of the
policy; the episodes, losses and checkpoints equal the colocated run's (``rollout_groups``).
"""

import time
from collections.abc import Iterator
from functools import partial

import torch

import tunelab.peft as peft
from tunelab.config import GRPOArgs, instantiate
from tunelab.data import PromptDataset, Tokenizer, padded_collate_prompts
from tunelab.distributed import (
    DeviceMeshes,
    build_device_meshes,
    destroy_distributed,
    init_distributed,
)
from tunelab.eval import TrainingEval
from tunelab.lifecycle import RunFolder, defer_stop_signals, recipe_main
from tunelab.rl import (
    EpisodeGroupSampler,
    EpisodeRunner,
    FrozenReference,
    GroupSampler,
    ModelRolloutEngine,
    RankSplit,
    RemoteRollouts,
    Rewards,
    RolloutPipeline,
    RolloutValidation,
    ScoredGroups,
    ThreadRollouts,
    bound_prompt_lengths,
    check_correction,
    check_policy_loss,
    global_sums,
    grpo_metrics,
    grpo_throughputs,
    lag_histogram,
    policy_gradient_pass,
    serve_rollouts,
    split_ranks,
    step_counts,
    store_logps,
    write_completions,
)
from tunelab.training import (
    AfterStep,
    Datasets,
    MetricLoggers,
    OptimizerStep,
    ReferenceModel,
    Schedule,
    StepProfiler,
    StepReports,
    TrainState,
    build_checkpoint_client,
    build_data,
    build_model,
    build_optimizer,
    config_fingerprint,
    output_layer,
    resume,
    seed_everything,
)

ARGS = GRPOArgs


def main(args: GRPOArgs) -> None:
    """Train with GRPO on ``args.dataset``'s prompts (LoRA adapters or every weight) and export."""
    # -- set-up: the process group first, everything else after it -------------------------
    # rollout.ranks > 0: the last ranks only sample; the trainers' group holds the others only.
    timeout_s = args.parallelism.collective_timeout_s
    split = split_ranks(args.rollout.ranks, timeout_s=timeout_s)
    if split is not None and split.is_rollout:
        return rollout_rank(args, split)
    dist_info = init_distributed(
        args.device, collective_timeout_s=timeout_s, store=split and split.trainer_store
    )
    run = RunFolder(args.output_dir)
    run.start(args.checkpoint.resume_from_checkpoint, may_exist=args.output_dir_may_exist)
    device = dist_info.device
    seed_everything(args.seed)
    tokenizer = instantiate(args.tokenizer)
    # HSDP when data_parallel_replicate_size > 1: shard within a node, replicate across nodes.
    meshes = build_device_meshes(device, args.parallelism)
    # lora: null is full fine-tuning (every weight trains).
    build = partial(build_model, args.model, device=device, meshes=meshes, seed=args.seed)
    model = build(lora=args.lora, adapter_dir=args.adapter_dir)
    # lm-eval tasks scored on the live model (eval.*): lm-eval, the tasks and their data are
    # checked here, so a bad task stops the run before its first step.
    benchmarks = TrainingEval(args.eval, model, tokenizer)
    # Micro-batches of prompts: each carries its prompts' dataset indices (for seeds and rows).
    data = build_data(
        Datasets(args.dataset, tokenizer, padded_collate_prompts, args.val_dataset),
        args.schedule,
        seed=args.seed,
        resume_from=run if args.checkpoint.resume_from_checkpoint else None,
        # Tensor-parallel ranks share their prompts (and ask the rollout ranks for the same).
        ranks_per_sample=args.parallelism.ranks_per_sample,
    )
    if args.lora is not None:
        trainable = list(peft.get_adapter_params(model).values())
    else:
        trainable = list(model.parameters())
    optimizer, lr_scheduler = build_optimizer(
        args.optimizer,
        trainable,
        lr_scheduler=args.lr_scheduler,
        num_training_steps=data.steps_per_epoch
        * args.schedule.epochs
        * args.rollout.num_iterations,
    )
    checkpoints = build_checkpoint_client(
        run,
        args.checkpoint,
        TrainState(model, optimizer, lr_scheduler, lora=args.lora),
        base_checkpoint_dir=args.model.path,
        tokenizer=tokenizer,
        config_hash=config_fingerprint(args),
    )
    # The policy loss (loss: _component_, a PolicyLoss); its beta > 0 needs the reference.
    loss_fn = check_policy_loss(instantiate(args.loss), "grpo_distributed")
    # The reference (beta > 0): with LoRA the policy itself with its adapters disabled (or the
    # frozen adapter_dir adapter); for full fine-tuning a frozen copy of the base.
    reference = None
    if loss_fn.beta > 0 and args.lora is not None:
        reference = ReferenceModel(
            model,
            freeze_current_adapter=args.adapter_dir is not None,
            wait_for_staging=checkpoints.wait_for_staging,
        )
    elif loss_fn.beta > 0:
        reference = FrozenReference(build(lora=None))
    engine = ModelRolloutEngine.from_rollout(model, args.rollout, tokenizer)
    # Every prompt fits the context with its completion (longer ones keep their last tokens,
    # counted), and a micro-batch's KV cache fits the device: checked before any allocation.
    prompt_sets = {"dataset": data.loader.dataset}
    if data.val_loader is not None:
        prompt_sets["val_dataset"] = data.val_loader.dataset
    bound_prompt_lengths(
        engine, prompt_sets, tokenizer, rows=data.loader.batch_size * args.rollout.num_generations
    )
    rewards = Rewards.from_settings(args.rewards)
    groups = rollout_groups(args, engine, tokenizer, rewards, data.loader.dataset, device)
    # Greedy completions of val_dataset: no random numbers drawn, so a resume stays exact.
    validate = None
    if data.val_loader is not None:
        validate = RolloutValidation(
            engine, rewards, data.val_loader, decode=tokenizer.decode, device=device
        )
    # The loss applies the output layer chunk by chunk: the logits never exist whole.
    output = output_layer(model) if args.model.chunked_output else None
    # Clip (schedule.clip_grad_norm); a NaN/inf loss or gradient stops the run before the update.
    optimizer_step = OptimizerStep.from_schedule(optimizer, trainable, lr_scheduler, args.schedule)

    # Asynchronous GRPO (rollout.mode async): each batch sampled by the policy max_lag updates
    # older, a fixed depth (RolloutPipeline); its token losses weighed by rollout.off_policy.
    # The batches in flight go into every step checkpoint. Sync is the depth-0 pipeline.
    max_lag = args.rollout.max_lag if args.rollout.mode == "async" else 0
    correction = check_correction(instantiate(args.rollout.off_policy))
    pipeline = RolloutPipeline(max_lag, device, correction)
    remote = RemoteRollouts(split, model, device) if split is not None else None
    # rollout.overlap (colocated async): the next batches sampled on a whole copy of the model
    # by a worker thread while each step trains (ThreadRollouts); the same results.
    overlap = None
    if args.rollout.overlap and split is None:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            whole = DeviceMeshes(None, None, whole=True)
            replica = build(lora=args.lora, adapter_dir=args.adapter_dir, meshes=whole)
        engine_copy = ModelRolloutEngine.from_rollout(replica, args.rollout, tokenizer)
        overlap = ThreadRollouts(
            model,
            replica,
            rollout_groups(args, engine_copy, tokenizer, rewards, data.loader.dataset, device),
        )
    if max_lag:
        data.progress_extras["rollouts_in_flight"] = pipeline.state_text

    # -- resume ---------------------------------------------------------------------------
    global_step, start_epoch = resume(checkpoints, data, args.checkpoint.resume_from_checkpoint)
    in_flight_record = (data.resumed_progress or {}).get("rollouts_in_flight")
    if max_lag and in_flight_record is not None:
        pipeline.load_text(in_flight_record, where=f"{run.step_dir(global_step)}")
    after_step = AfterStep(
        checkpoints,
        data,
        Schedule(args.schedule, args.checkpoint),
        StepReports(
            MetricLoggers(args.metric_loggers, enabled=dist_info.is_main),
            StepProfiler(run.profile_dir, args.profile),
            validate=validate,
            benchmarks=benchmarks,
        ),
        global_step=global_step,
        device=device,
    )
    if remote is not None:  # a stop signal also stops the rollout ranks
        after_step.preemption.also_close(remote)

    # -- train ----------------------------------------------------------------------------
    def sample(batches: Iterator, step: int) -> list[ScoredGroups]:
        # G completions per prompt of the step's micro-batches, scored, advantages per group;
        # with dynamic sampling, groups of equal rewards left out and (optionally) refilled.
        indices = [next(batches)["index"].tolist() for _ in range(data.gradient_accumulation_steps)]
        if remote is not None:  # a rollout rank samples them with the live policy
            return remote.request(indices, step, policy_step=global_step)
        if overlap is not None:  # the worker thread samples them with the live policy
            return overlap.request(indices, step)
        scored = [groups.sample(index, step) for index in indices]
        if args.rollout.dynamic_sampling_refill_rounds:
            scored += groups.refill(
                scored,
                step,
                prompts_per_round=data.loader.batch_size,
                max_rounds=args.rollout.dynamic_sampling_refill_rounds,
            )
        return scored

    model.train()
    for epoch in range(start_epoch, args.schedule.epochs):
        batches = data.epoch(epoch)
        epoch_start = epoch * data.steps_per_epoch
        epoch_end = epoch_start + data.steps_per_epoch
        # Resumed mid-epoch: the batches in flight drew the prompts after the saved position.
        for _ in range(pipeline.num_micro_batches()):
            next(batches)
        for step_in_epoch in range(data.step_in_epoch() + 1, data.steps_per_epoch + 1):
            after_step.start_step()
            # 1. Rollouts: every batch up to max_lag steps ahead sampled with the live policy
            # (max_lag 0: this step's batch, synchronous GRPO), then this step's taken.
            sample_start = time.perf_counter()
            pipeline.fill(global_step, epoch_end, partial(sample, batches))
            sample_seconds = time.perf_counter() - sample_start
            in_flight = pipeline.take(global_step)
            scored = in_flight.parts
            records = [record for part in scored for record in part.records]
            # Tensor-parallel ranks hold the same completions: each written once.
            write_completions(
                run.step_log("completions.jsonl"), global_step + 1, records,
                copies=args.parallelism.tensor_parallel_size,
            )  # fmt: skip
            rollouts = [part.rollout for part in scored]
            counts = step_counts(scored, device)
            train_start = time.perf_counter()
            # 2. The reference's log-probs (beta > 0). The sampling policy's are those of the
            # first pass (before the first update): kept there for the next iterations.
            store_logps(rollouts, model, output, old=False, reference=reference)
            divisor = loss_fn.normalizer(
                num_sequences=int(counts["num_sequences"]),
                num_tokens=int(counts["num_tokens"]),
                max_new_tokens=args.rollout.max_new_tokens,
            )
            # 3. num_iterations optimizer steps over the same rollouts.
            for iteration in range(args.rollout.num_iterations):
                # FSDP2 averages gradients over ranks: scale by the world size.
                step_sums = policy_gradient_pass(
                    model,
                    rollouts,
                    loss_fn,
                    output,
                    scale=dist_info.world_size / divisor,
                    keep_old=iteration == 0 and args.rollout.num_iterations > 1,
                )
                step_totals = global_sums(step_sums, device)
                metrics = optimizer_step(loss=step_totals["loss"] / divisor, step=global_step + 1)
            global_step += 1
            # Split ranks: the new policy goes out now, in the background, when it will sample.
            next_epoch = epoch + 1 < args.schedule.epochs
            if remote is not None and pipeline.samples_with(global_step, epoch_end, next_epoch):
                remote.send_policy(global_step)
            # 4. Log, validate, export, save.
            metrics |= grpo_metrics(counts, step_totals, args.rollout, divisor=divisor)
            metrics |= grpo_throughputs(
                counts,
                world_size=dist_info.world_size,
                train_seconds=time.perf_counter() - train_start,
                token_copies=args.parallelism.tensor_parallel_size,
                num_iterations=args.rollout.num_iterations,
            )
            metrics["off_policy/lag"] = global_step - 1 - in_flight.behaviour_step
            metrics["off_policy/sample_seconds"] = sample_seconds
            metrics |= lag_histogram(global_step, max_lag, data.steps_per_epoch)
            if remote is not None:
                metrics |= remote.metrics()
            after_step(
                global_step, epoch, step_in_epoch, metrics, num_tokens=counts["completion_tokens"]
            )

    # -- clean-up -------------------------------------------------------------------------
    if remote is not None:
        remote.close()
    if overlap is not None:
        overlap.close()
    after_step.close()
    if dist_info.is_main:
        print(f"finished at step {global_step}; outputs in {args.output_dir}", flush=True)
    destroy_distributed()


def rollout_rank(args: GRPOArgs, split: RankSplit) -> None:
    """A rollout rank (``rollout.ranks``): samples and scores the batches its trainers ask for."""
    # A stop signal ends this rank when its trainers stop it, after their checkpoint.
    defer_stop_signals()
    device = split.device(args.device)
    seed_everything(args.seed)
    tokenizer = instantiate(args.tokenizer)
    # Its own whole model (no process group, so no tensor parallelism either): the trainers
    # send the policy before each use.
    meshes = build_device_meshes(device)
    model = build_model(
        args.model, lora=args.lora, adapter_dir=args.adapter_dir, device=device, meshes=meshes,
        seed=args.seed,
    )  # fmt: skip
    engine = ModelRolloutEngine.from_rollout(model, args.rollout, tokenizer)
    prompts = instantiate(args.dataset, tokenizer=tokenizer)
    # Prompts cut as the trainers cut theirs (longer ones keep their last tokens).
    rows = args.schedule.batch_size * args.rollout.num_generations
    bound_prompt_lengths(engine, {"dataset": prompts}, tokenizer, rows=rows)
    groups = rollout_groups(
        args, engine, tokenizer, Rewards.from_settings(args.rewards), prompts, device
    )
    model.train()
    serve_rollouts(
        split, groups, model, refill_rounds=args.rollout.dynamic_sampling_refill_rounds,
        prompts_per_round=args.schedule.batch_size,
    )  # fmt: skip


def rollout_groups(
    args: GRPOArgs,
    engine: ModelRolloutEngine,
    tokenizer: Tokenizer,
    rewards: Rewards,
    prompts: PromptDataset,
    device: torch.device,
) -> GroupSampler:
    """The rollout phase on ``engine``'s model: completions, or episodes (``agentic``).

    The same on the training processes, on the sampling thread's copy (``rollout.overlap``)
    and on a rollout rank (``rollout.ranks``): the episode loop agrees over the ranks only
    where forwards communicate, so a whole copy samples its episodes on its own.
    """
    if args.agentic is None:
        return GroupSampler.from_settings(
            engine, rewards, prompts, args.rollout, seed=args.seed, device=device
        )
    # Episodes: turns with tool calls, one KV cache across them.
    runner = EpisodeRunner.from_settings(engine, tokenizer, args.agentic)
    return EpisodeGroupSampler.from_runner(
        runner, rewards, prompts, args.rollout, seed=args.seed, device=device
    )


if __name__ == "__main__":
    recipe_main(main, ARGS)
