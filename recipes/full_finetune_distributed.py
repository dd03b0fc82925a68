"""Full fine-tuning of a decoder LLM on 1..N processes (FSDP2 over torchrun).

Launch: ``tunelab run --nproc_per_node 2 full_finetune_distributed --config tiny/full``.
Copy it to customise: ``tunelab cp full_finetune_distributed my_full.py``.

Reads top to bottom: set-up, resume, the training loop (each optimizer step: forward, loss and
backward over its micro-batches, then clip and step; then ``after_step`` logs, validates,
scores the ``eval.tasks`` when due, exports and saves), clean-up. Every building block takes
the settings it uses, so a copy may declare its own settings dataclass in place of
``FullFinetuneArgs``.
"""

import torch

from tunelab.config import FullFinetuneArgs, instantiate
from tunelab.data import sft_collate
from tunelab.distributed import (
    all_reduce_sum,
    build_context_parallel,
    build_device_meshes,
    destroy_distributed,
    init_distributed,
)
from tunelab.eval import TrainingEval
from tunelab.lifecycle import RunFolder, recipe_main
from tunelab.training import (
    ActivationOffload,
    AfterStep,
    Datasets,
    MetricLoggers,
    OptimizerStep,
    RouterLoss,
    Schedule,
    StepProfiler,
    StepReports,
    TrainState,
    batch_loss,
    build_checkpoint_client,
    build_data,
    build_model,
    build_optimizer,
    config_fingerprint,
    evaluate,
    global_token_count,
    output_layer,
    resume,
    seed_everything,
    to_device,
)

ARGS = FullFinetuneArgs


def main(args: FullFinetuneArgs) -> None:
    """Train every weight on ``args.dataset`` and export the model."""
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
    # HSDP when data_parallel_replicate_size > 1: shard within a node, replicate across nodes.
    # Context parallelism when context_parallel_size > 1: its ranks split every sequence.
    # Tensor parallelism when tensor_parallel_size > 1: its ranks split every matmul.
    meshes = build_device_meshes(device, args.parallelism)
    context = build_context_parallel(args.parallelism.context_parallel_size, meshes)
    model = build_model(
        args.model,
        device=device,
        meshes=meshes,
        seed=args.seed,
    )
    # lm-eval tasks scored on the live model (eval.*): lm-eval, the tasks and their data are
    # checked here, so a bad task stops the run before its first step.
    benchmarks = TrainingEval(args.eval, model, tokenizer)
    data = build_data(
        # A vision-language model's collate also reads each batch's images.
        Datasets(args.dataset, tokenizer, sft_collate(tokenizer), args.val_dataset),
        args.schedule,
        seed=args.seed,
        # A resume on another number of processes keeps the run's global batch.
        resume_from=run if args.checkpoint.resume_from_checkpoint else None,
        # Context- and tensor-parallel ranks share their samples.
        ranks_per_sample=args.parallelism.ranks_per_sample,
        model_context=model.args.max_seq_len,
    )
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer, lr_scheduler = build_optimizer(
        args.optimizer,
        trainable,
        lr_scheduler=args.lr_scheduler,
        num_training_steps=data.steps_per_epoch * args.schedule.epochs,
    )
    loss_fn = instantiate(args.loss)
    # The loss applies the output layer chunk by chunk: the logits never exist whole.
    output = output_layer(model) if args.model.chunked_output else None
    # A mixture-of-experts model's router load-balancing loss joins the objective (dense: none).
    router_loss = RouterLoss(model, args.router, context=context)
    checkpoints = build_checkpoint_client(
        run,
        args.checkpoint,
        TrainState(model, optimizer, lr_scheduler),
        base_checkpoint_dir=args.model.path,
        tokenizer=tokenizer,
        config_hash=config_fingerprint(args),
    )
    # Clip (schedule.clip_grad_norm); a NaN/inf loss or gradient stops the run before the update.
    optimizer_step = OptimizerStep.from_schedule(optimizer, trainable, lr_scheduler, args.schedule)
    # offload_activations: the forward's saved activations wait in pinned host memory (CUDA).
    offload = ActivationOffload(args.model.offload_activations, device)

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
                lambda: {
                    "val_loss": evaluate(model, data.val_loader, loss_fn, device, output, context)
                }
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
            # With context parallelism each rank keeps its slice of every sequence.
            micro_batches = [
                context.shard(to_device(next(batches), device))
                for _ in range(data.gradient_accumulation_steps)
            ]
            # The step's loss: token losses summed over micro-batches and ranks, divided by their
            # number of target tokens, so every token weighs the same at any world size.
            num_tokens = global_token_count(micro_batches)
            total_loss = torch.zeros((), dtype=torch.float64, device=device)
            for batch in micro_batches:
                routing = router_loss.stats(batch)
                with offload():
                    loss_sum, _ = batch_loss(loss_fn, model, batch, output, routing, context)
                # FSDP2 averages gradients over ranks: scale by the world size to get a global sum.
                objective = loss_sum * dist_info.world_size / num_tokens
                (objective + router_loss.term(routing, len(micro_batches))).backward()
                total_loss += loss_sum.detach()
            loss = (all_reduce_sum(total_loss) / num_tokens).item()
            metrics = optimizer_step(loss=loss, step=global_step + 1)
            global_step += 1
            # Progress, metrics, validation, export, save, and a stop signal's checkpoint.
            after_step(
                global_step,
                epoch,
                step_in_epoch,
                {**metrics, "loss": loss, **router_loss.step_metrics()},
                num_tokens=num_tokens.item(),
            )

    # -- clean-up -------------------------------------------------------------------------
    after_step.close()
    if dist_info.is_main:
        print(f"finished at step {global_step}; outputs in {args.output_dir}", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    recipe_main(main, ARGS)
