"""Reward-model training (Bradley-Terry) of a decoder LLM on preference pairs, 1..N processes.

Launch: ``tunelab run --nproc_per_node 2 reward_model_distributed --config tiny/reward_model``.
Copy it to customise: ``tunelab cp reward_model_distributed my_reward_model.py``.

The model is the decoder with a scalar ``score`` head on its last non-pad token
(``tunelab.models.classifier.SequenceClassifier``, transformers' ``*ForSequenceClassification``
layout). With ``lora`` the adapters and the whole head train (the head is PEFT's
``modules_to_save``); with ``lora: null`` every weight does. The loss is
``-log sigmoid(r_chosen - r_rejected - margin)`` (plus the optional centering term), a step's
loss the mean over all its pairs; validation logs ``val_accuracy`` and ``val_margin``. Exports
load in ``transformers.AutoModelForSequenceClassification`` (LoRA: the PEFT adapter with the
head, then the merged model).

Reads top to bottom: set-up, resume, the training loop (each optimizer step: one forward over
the chosen and rejected rows of each micro-batch, loss and backward, then clip and step; then
``after_step`` logs, validates, exports and saves), clean-up.
"""

from tunelab.config import RewardModelArgs, instantiate
from tunelab.data import padded_collate_dpo
from tunelab.distributed import build_device_meshes, destroy_distributed, init_distributed
from tunelab.lifecycle import RunFolder, recipe_main
from tunelab.losses import accumulate_metrics
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
    check_reward_loss,
    config_fingerprint,
    evaluate_rewards,
    global_pair_count,
    global_preference_metrics,
    resume,
    reward_loss,
    seed_everything,
    to_device,
)

ARGS = RewardModelArgs


def main(args: RewardModelArgs) -> None:
    """Train a reward model on preference pairs and export it for sequence classification."""
    # -- set-up: the process group first, everything else after it -------------------------
    dist_info = init_distributed(
        args.device, collective_timeout_s=args.parallelism.collective_timeout_s
    )
    # One run per output_dir: the lock first, then the resume setting, then the clean-up of a
    # killed run's leftovers; a second run stops here, before loading anything.
    run = RunFolder(args.output_dir)
    run.start(args.checkpoint.resume_from_checkpoint, may_exist=args.output_dir_may_exist)
    device = dist_info.device
    seed_everything(args.seed)
    tokenizer = instantiate(args.tokenizer)
    loss_fn = check_reward_loss(instantiate(args.loss))
    model = build_model(
        args.model,
        device=device,
        # HSDP, tensor and expert parallelism as the parallelism section says.
        meshes=build_device_meshes(device, args.parallelism),
        lora=args.lora,
        adapter_dir=args.adapter_dir,
        seed=args.seed,
    )
    # The score is read at each row's last non-pad token, and exports record the pad id.
    model.pad_token_id = pad_id = tokenizer.pad_id
    data = build_data(
        Datasets(args.dataset, tokenizer, padded_collate_dpo, args.val_dataset),
        args.schedule,
        seed=args.seed,
        # A resume on another number of processes keeps the run's global batch.
        resume_from=run if args.checkpoint.resume_from_checkpoint else None,
        model_context=model.args.max_seq_len,
        # Tensor-parallel ranks share their samples.
        ranks_per_sample=args.parallelism.ranks_per_sample,
    )
    # LoRA: the adapters and the score head; full fine-tuning: every weight.
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer, lr_scheduler = build_optimizer(
        args.optimizer,
        trainable,
        lr_scheduler=args.lr_scheduler,
        num_training_steps=data.steps_per_epoch * args.schedule.epochs,
    )
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

    # -- resume ---------------------------------------------------------------------------
    global_step, start_epoch = resume(checkpoints, data, args.checkpoint.resume_from_checkpoint)

    def validate() -> dict[str, float]:
        metrics = evaluate_rewards(model, data.val_loader, loss_fn, device, pad_id)
        return {f"val_{key}": value for key, value in metrics.items()}

    after_step = AfterStep(
        checkpoints,
        data,
        Schedule(args.schedule, args.checkpoint),
        StepReports(
            MetricLoggers(args.metric_loggers, enabled=dist_info.is_main),
            StepProfiler(run.profile_dir, args.profile),
            validate=validate if data.val_loader is not None else None,
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
            # The step's loss: the mean over all its pairs, across micro-batches and ranks.
            num_pairs = global_pair_count(micro_batches)
            sums = None
            for batch in micro_batches:
                losses, batch_sums = reward_loss(loss_fn, model, batch, pad_id)
                # FSDP2 averages gradients over ranks: scale by the world size to get a global sum.
                (losses.sum() * dist_info.world_size / num_pairs).backward()
                sums = accumulate_metrics(sums, batch_sums)
            step_metrics, num_tokens = global_preference_metrics(sums, num_pairs)
            metrics = optimizer_step(loss=step_metrics["loss"], step=global_step + 1)
            global_step += 1
            # Progress, metrics, validation, export, save, and a stop signal's checkpoint.
            metrics |= step_metrics
            after_step(global_step, epoch, step_in_epoch, metrics, num_tokens=num_tokens)

    # -- clean-up -------------------------------------------------------------------------
    after_step.close()
    if dist_info.is_main:
        print(f"finished at step {global_step}; outputs in {args.output_dir}", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    recipe_main(main, ARGS)
