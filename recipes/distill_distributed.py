"""Knowledge distillation, offline and on-policy: a student learns a frozen teacher, 1..N processes.

Launch: ``tunelab run --nproc_per_node 2 distill_distributed --config tiny/distill``.
Copy it to customise: ``tunelab cp distill_distributed my_distill.py``.

The student trains with LoRA, QLoRA (``lora.quantize_base: nf4``) or every weight
(``lora: null``); the teacher (``teacher:``, its own folder and dtype, the student's
vocabulary) is frozen and FSDP2-sharded like the student, or kept gathered on every process
(``teacher.reshard_after_forward: false``). Each optimizer step: 1. with probability
``on_policy.lmbda`` (a seeded draw per step) the step is on-policy: each micro-batch's prompts
get the student's own sampled completions (GKD); otherwise the dataset's rows are used as they
are (offline KD, masks as in SFT); 2. per micro-batch the teacher's forward (no gradient), the
student's forward, and the distillation loss (``loss:``, a ``DistillationLoss``: forward KL,
reverse KL or generalized JSD, chunked over positions so neither model's logits exist whole),
summed over scored tokens and divided by their global count; 3. clip and step; then
``after_step`` logs (loss, its parts, teacher-student KL, student entropy, tokens/s),
validates, exports (adapter first) and saves.
"""

import torch

import tunelab.peft as peft
from tunelab.config import DistillArgs, instantiate
from tunelab.data import padded_collate_sft
from tunelab.distill import (
    OnPolicyBatches,
    Teacher,
    TeacherTopKCache,
    distill_batch,
    evaluate_distillation,
    step_metrics,
)
from tunelab.distributed import (
    all_reduce_sum,
    build_device_meshes,
    destroy_distributed,
    init_distributed,
)
from tunelab.eval import TrainingEval
from tunelab.lifecycle import RunFolder, recipe_main
from tunelab.training import (
    AfterStep,
    Datasets,
    MetricLoggers,
    OptimizerStep,
    Schedule,
    StepProfiler,
    StepReports,
    TrainState,
    build_checkpoint_client,
    build_data,
    build_model,
    build_optimizer,
    config_fingerprint,
    global_token_count,
    output_layer,
    resume,
    seed_everything,
    to_device,
)

ARGS = DistillArgs


def main(args: DistillArgs) -> None:
    """Distill ``args.teacher`` into the student ``args.model`` and export the student."""
    # -- set-up: the process group first, everything else after it -------------------------
    dist_info = init_distributed(
        args.device, collective_timeout_s=args.parallelism.collective_timeout_s
    )
    run = RunFolder(args.output_dir)
    run.start(args.checkpoint.resume_from_checkpoint, may_exist=args.output_dir_may_exist)
    device = dist_info.device
    seed_everything(args.seed)
    tokenizer = instantiate(args.tokenizer)
    meshes = build_device_meshes(device, args.parallelism)
    # lora: null is full fine-tuning of the student (every weight trains).
    model = build_model(
        args.model,
        device=device,
        meshes=meshes,
        lora=args.lora,
        adapter_dir=args.adapter_dir,
        seed=args.seed,
    )
    loss_fn = instantiate(args.loss)
    benchmarks = TrainingEval(args.eval, model, tokenizer)
    # teacher.precompute_top_k: batches carry their dataset index, to find their cached rows.
    precompute = args.teacher.precompute_top_k
    data = build_data(
        Datasets(
            args.dataset, tokenizer, padded_collate_sft, args.val_dataset, index_pairs=precompute
        ),
        args.schedule,
        seed=args.seed,
        resume_from=run if args.checkpoint.resume_from_checkpoint else None,
        model_context=model.args.max_seq_len,
        # Tensor-parallel ranks share their samples.
        ranks_per_sample=args.parallelism.ranks_per_sample,
    )
    # The teacher's top-k stored with the dataset cache: found, or computed below.
    spot = None
    if precompute:
        spot = TeacherTopKCache.locate(
            data.loader.dataset, tokenizer, loss_fn, args.teacher.path, args.teacher.dtype
        )
    # The frozen teacher: its own folder and dtype, the student's vocabulary (special tokens
    # mapped by content, in one line; any other difference refused in one line).
    # With a finished cache it is loaded only for validation or on-policy steps.
    chunked = args.model.chunked_output
    teacher = None
    validates = data.val_loader is not None
    if spot is None or not spot.exists or validates or args.on_policy.lmbda > 0:
        teacher = Teacher(
            build_model(args.teacher, device=device, meshes=meshes, seed=args.seed),
            model,
            chunked=chunked,
            teacher_path=args.teacher.path,
            student_tokenizer=args.student_tokenizer_dir(),
        )
    top_k_cache = spot.open_or_build(teacher, loss_fn, data.loader, device) if spot else None
    if teacher is None and dist_info.is_main:
        print(f"the teacher is not loaded: its top-k is read from {spot.folder}", flush=True)
    if args.lora is not None:
        trainable = list(peft.get_adapter_params(model).values())
    else:
        trainable = list(model.parameters())
    optimizer, lr_scheduler = build_optimizer(
        args.optimizer,
        trainable,
        lr_scheduler=args.lr_scheduler,
        num_training_steps=data.steps_per_epoch * args.schedule.epochs,
    )
    # Both output layers run inside the loss, chunk by chunk: no [batch, seq, vocab] logits.
    output = output_layer(model) if chunked else None
    checkpoints = build_checkpoint_client(
        run,
        args.checkpoint,
        TrainState(model, optimizer, lr_scheduler, lora=args.lora),
        base_checkpoint_dir=args.model.path,
        tokenizer=tokenizer,
        config_hash=config_fingerprint(args),
    )
    # Clip (schedule.clip_grad_norm); a NaN/inf loss or gradient stops the run before the update.
    optimizer_step = OptimizerStep.from_schedule(optimizer, trainable, lr_scheduler, args.schedule)
    # On-policy steps (on_policy.lmbda > 0): the student samples completions of the prompts.
    on_policy = OnPolicyBatches.from_settings(model, args.on_policy, tokenizer, args.seed)

    # -- resume ---------------------------------------------------------------------------
    global_step, start_epoch = resume(checkpoints, data, args.checkpoint.resume_from_checkpoint)
    after_step = AfterStep(
        checkpoints,
        data,
        Schedule(args.schedule, args.checkpoint),
        StepReports(
            MetricLoggers(args.metric_loggers, enabled=dist_info.is_main),
            StepProfiler(run.profile_dir, args.profile),
            validate=data.val_loader
            and (
                lambda: evaluate_distillation(
                    model, teacher, data.val_loader, loss_fn, device, output
                )
            ),
            benchmarks=benchmarks,
        ),
        global_step=global_step,
        device=device,
    )

    # -- train ----------------------------------------------------------------------------
    model.train()
    for epoch in range(start_epoch, args.schedule.epochs):
        batches = data.epoch(epoch)
        for step_in_epoch in range(data.step_in_epoch() + 1, data.steps_per_epoch + 1):
            after_step.start_step()
            micro_batches = [
                to_device(next(batches), device) for _ in range(data.gradient_accumulation_steps)
            ]
            # 1. On-policy step: the student's completions of the same prompts replace the rows.
            sampled = on_policy.chooses(global_step)
            if sampled:
                micro_batches = [on_policy.sample(batch, global_step) for batch in micro_batches]
            # 2. Teacher and student forwards and the loss: token sums over micro-batches and
            # ranks divided by their number of scored tokens.
            num_tokens = global_token_count(micro_batches)
            total_loss = torch.zeros((), dtype=torch.float64, device=device)
            metric_sums: dict[str, torch.Tensor] = {}
            # Offline steps with teacher.precompute_top_k read the teacher from its cache.
            source = top_k_cache if top_k_cache is not None and not sampled else teacher
            for batch in micro_batches:
                sums = distill_batch(loss_fn, model, source, batch, output)
                # FSDP2 averages gradients over ranks: scale by the world size to get a global sum.
                (sums.loss_sum * dist_info.world_size / num_tokens).backward()
                total_loss += sums.loss_sum.detach()
                for name, value in sums.metrics.items():
                    metric_sums[name] = metric_sums.get(name, 0) + value
            loss = (all_reduce_sum(total_loss) / num_tokens).item()
            # 3. Clip and step; log, validate, export, save.
            metrics = optimizer_step(loss=loss, step=global_step + 1)
            global_step += 1
            metrics |= step_metrics(metric_sums, num_tokens.item())
            after_step(
                global_step,
                epoch,
                step_in_epoch,
                {
                    **metrics,
                    "loss": loss,
                    "on_policy": float(sampled),
                    # Tensor-parallel ranks score the same tokens: count each once.
                    "scored_tokens": num_tokens.item() / args.parallelism.tensor_parallel_size,
                },
                num_tokens=num_tokens.item(),
            )

    # -- clean-up -------------------------------------------------------------------------
    after_step.close()
    if dist_info.is_main:
        print(f"finished at step {global_step}; outputs in {args.output_dir}", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    recipe_main(main, ARGS)
