"""LoRA preference tuning (DPO, IPO, hinge, SimPO, ORPO) of a decoder LLM on 1..N processes.

Launch: ``tunelab run --nproc_per_node 2 lora_dpo_distributed --config tiny/lora_dpo``.
Copy it to customise: ``tunelab cp lora_dpo_distributed my_dpo.py``.

The reference model is the policy itself, never a second copy in memory: inside
``reference.active()`` it is the base model (adapters disabled), or, when starting from an SFT
adapter (``adapter_dir``), base + that adapter, frozen (``tunelab.training.ReferenceModel``).
With ``reference_logps: precompute`` it runs once over the dataset before training
(``tunelab.training.PrecomputedReference``). A step's loss is the mean over all its pairs.

Reads top to bottom: set-up, resume, the training loop (each optimizer step: reference and
policy forwards, loss and backward over its micro-batches, then clip and step; then
``after_step`` logs, validates, exports and saves), clean-up.
"""

import tunelab.peft as peft
from tunelab.config import LoRADPOArgs, instantiate
from tunelab.data import preference_collate
from tunelab.distributed import build_device_meshes, destroy_distributed, init_distributed
from tunelab.eval import TrainingEval
from tunelab.lifecycle import RunFolder, recipe_main
from tunelab.losses import accumulate_metrics
from tunelab.training import (
    AfterStep,
    Datasets,
    MetricLoggers,
    OptimizerStep,
    PrecomputedReference,
    ReferenceModel,
    Schedule,
    StepProfiler,
    StepReports,
    TrainState,
    build_checkpoint_client,
    build_data,
    build_model,
    build_optimizer,
    check_preference_loss,
    config_fingerprint,
    evaluate_preference,
    global_chosen_tokens_per_pair,
    global_pair_count,
    global_preference_metrics,
    output_layer,
    policy_forward,
    preference_loss,
    resume,
    seed_everything,
    step_references,
    to_device,
)

ARGS = LoRADPOArgs


def main(args: LoRADPOArgs) -> None:
    """Train LoRA adapters on preference pairs and export adapter and merged model."""
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
    loss_fn = check_preference_loss(instantiate(args.loss), "lora_dpo_distributed")
    model = build_model(
        args.model,
        device=device,
        # HSDP, tensor and expert parallelism as the parallelism section says.
        meshes=build_device_meshes(device, args.parallelism),
        lora=args.lora,
        adapter_dir=args.adapter_dir,
        seed=args.seed,
    )
    # lm-eval tasks scored on the live model (eval.*): lm-eval, the tasks and their data are
    # checked here, so a bad task stops the run before its first step.
    benchmarks = TrainingEval(args.eval, model, tokenizer)
    # Batches carry their pairs' dataset indices (pair_index), for reference_logps: precompute.
    data = build_data(
        Datasets(
            args.dataset,
            tokenizer,
            preference_collate(tokenizer),
            args.val_dataset,
            index_pairs=True,
        ),
        args.schedule,
        seed=args.seed,
        # A resume on another number of processes keeps the run's global batch.
        resume_from=run if args.checkpoint.resume_from_checkpoint else None,
        model_context=model.args.max_seq_len,
        # Tensor-parallel ranks share their samples.
        ranks_per_sample=args.parallelism.ranks_per_sample,
    )
    trainable = list(peft.get_adapter_params(model).values())
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
    # Snapshots the SFT adapter, so before resume or training changes it. Swapping it in edits
    # adapter weights in place: first wait for an async save staging them.
    reference = ReferenceModel(
        model,
        freeze_current_adapter=args.adapter_dir is not None,
        wait_for_staging=checkpoints.wait_for_staging,
    )
    # The losses apply the output layer chunk by chunk: the logits never exist whole.
    output = output_layer(model) if args.model.chunked_output else None
    # reference_logps: precompute: every pair's reference log-probs once, before training. The
    # reference is frozen, so a resumed run recomputes the same table (nothing to save).
    precomputed = None
    if args.reference_logps == "precompute" and loss_fn.needs_reference:
        precomputed = PrecomputedReference.compute(reference, data.loader, device, output=output)
    # Clip (schedule.clip_grad_norm); a NaN/inf loss or gradient stops the run before the update.
    optimizer_step = OptimizerStep.from_schedule(optimizer, trainable, lr_scheduler, args.schedule)

    # -- resume ---------------------------------------------------------------------------
    global_step, start_epoch = resume(checkpoints, data, args.checkpoint.resume_from_checkpoint)

    def validate() -> dict[str, float]:
        metrics = evaluate_preference(
            model, data.val_loader, loss_fn, reference, device, output=output
        )
        return {f"val_{key}": value for key, value in metrics.items()}

    after_step = AfterStep(
        checkpoints,
        data,
        Schedule(args.schedule, args.checkpoint),
        StepReports(
            MetricLoggers(args.metric_loggers, enabled=dist_info.is_main),
            StepProfiler(run.profile_dir, args.profile),
            validate=validate if data.val_loader is not None else None,
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
            # Reference log-probs first: all micro-batches under one swap, or looked up in the
            # precomputed table (SimPO and ORPO need none).
            references = step_references(
                model, micro_batches, loss_fn, reference, precomputed, output=output
            )
            # The step's loss: the mean over all its pairs, across micro-batches and ranks.
            num_pairs = global_pair_count(micro_batches)
            # ORPO's NLL: a mean over all the step's chosen tokens.
            tokens_per_pair = None
            if loss_fn.adds_chosen_nll:
                tokens_per_pair = global_chosen_tokens_per_pair(micro_batches, num_pairs)
            sums = None
            for batch, ref in zip(micro_batches, references, strict=True):
                policy = policy_forward(model, batch, output=output)
                losses, batch_sums = preference_loss(loss_fn, policy, ref, tokens_per_pair)
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
