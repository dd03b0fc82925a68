"""LoRA KTO of a decoder LLM on unpaired completions labelled desirable or not, on 1..N processes.

Launch: ``tunelab run --nproc_per_node 2 kto_distributed --config tiny/kto``.
Copy it to customise: ``tunelab cp kto_distributed my_kto.py``.

KTO (Ethayarajh et al. 2024) learns from thumbs up / thumbs down without pairs. Its own recipe,
not a loss of lora_dpo_distributed: its rows are single labelled completions (each batch also
carries every completion's mismatched pair, ``tunelab.data.kto_dataset``), and its step first
estimates the KL reference point ``z0`` over the whole step before any loss. The reference is
DPO's, unchanged (``tunelab.training.ReferenceModel``: the base with adapters disabled, or base +
the SFT adapter, frozen; ``reference_logps: precompute`` runs it once up front). A step's loss is
the mean over all its rows.

Reads top to bottom: set-up, resume, the training loop (each optimizer step: the reference's
forward and the policy's of the mismatched pairs, ``z0``, then the completions' forward, loss
and backward per micro-batch, clip and step; then ``after_step``), clean-up. A step of one
micro-batch runs the policy once over completions and mismatched pairs together.
"""

import tunelab.peft as peft
from tunelab.config import LoRAKTOArgs, instantiate
from tunelab.data import padded_collate_kto
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
    check_unpaired_loss,
    completion_forward,
    config_fingerprint,
    evaluate_kto,
    global_kto_metrics,
    global_pair_count,
    kto_forward,
    kto_loss,
    mismatched_logps,
    output_layer,
    resume,
    seed_everything,
    step_kl,
    step_references,
    to_device,
)

ARGS = LoRAKTOArgs


def main(args: LoRAKTOArgs) -> None:
    """Train LoRA adapters with KTO and export adapter and merged model."""
    # -- set-up: the process group first, everything else after it -------------------------
    dist_info = init_distributed(
        args.device, collective_timeout_s=args.parallelism.collective_timeout_s
    )
    run = RunFolder(args.output_dir)
    run.start(args.checkpoint.resume_from_checkpoint, may_exist=args.output_dir_may_exist)
    device = dist_info.device
    seed_everything(args.seed)
    tokenizer = instantiate(args.tokenizer)
    loss_fn = check_unpaired_loss(instantiate(args.loss), "kto_distributed")
    model = build_model(
        args.model,
        device=device,
        meshes=build_device_meshes(device, args.parallelism),
        lora=args.lora,
        adapter_dir=args.adapter_dir,
        seed=args.seed,
    )
    benchmarks = TrainingEval(args.eval, model, tokenizer)
    # Batches carry their rows' dataset indices (pair_index), for reference_logps: precompute.
    data = build_data(
        Datasets(args.dataset, tokenizer, padded_collate_kto, args.val_dataset, index_pairs=True),
        args.schedule,
        seed=args.seed,
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
    reference = ReferenceModel(
        model,
        freeze_current_adapter=args.adapter_dir is not None,
        wait_for_staging=checkpoints.wait_for_staging,
    )
    output = output_layer(model) if args.model.chunked_output else None
    # The mismatched pairs are fixed by dataset index, so their reference log-probs can be too.
    precomputed = None
    if args.reference_logps == "precompute" and loss_fn.needs_reference:
        precomputed = PrecomputedReference.compute(
            reference, data.loader, device, output=output, unit="rows"
        )
    # Clip (schedule.clip_grad_norm); a NaN/inf loss or gradient stops the run before the update.
    optimizer_step = OptimizerStep.from_schedule(optimizer, trainable, lr_scheduler, args.schedule)

    # -- resume ---------------------------------------------------------------------------
    global_step, start_epoch = resume(checkpoints, data, args.checkpoint.resume_from_checkpoint)

    def validate() -> dict[str, float]:
        metrics = evaluate_kto(model, data.val_loader, loss_fn, reference, device, output=output)
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
            # Without gradient: the reference on completions and mismatched pairs.
            references = step_references(
                model, micro_batches, loss_fn, reference, precomputed, output=output
            )
            # The policy on the mismatched pairs, then z0 over every mismatched pair of the
            # step, all ranks. One micro-batch: one forward of completions and mismatched pairs
            # (their shared prompts once), with gradient; else a pass without gradient first.
            policies = [None] * len(micro_batches)
            if len(micro_batches) == 1:
                policies[0], mismatched = kto_forward(model, micro_batches[0], output=output)
                kl = step_kl([mismatched], references)
            else:
                kl = step_kl(mismatched_logps(model, micro_batches, output=output), references)
            # The step's loss: the mean over all its rows, across micro-batches and ranks.
            num_rows = global_pair_count(micro_batches)
            sums = None
            for batch, ref, policy in zip(micro_batches, references, policies, strict=True):
                policy = policy or completion_forward(model, batch, output=output)
                losses, batch_sums = kto_loss(loss_fn, policy, ref, batch["desirable"], kl)
                # FSDP2 averages gradients over ranks: scale by the world size to get a global sum.
                (losses.sum() * dist_info.world_size / num_rows).backward()
                sums = accumulate_metrics(sums, batch_sums)
            step_metrics, num_tokens = global_kto_metrics(sums, num_rows, kl)
            metrics = optimizer_step(loss=step_metrics["loss"], step=global_step + 1)
            global_step += 1
            metrics |= step_metrics
            after_step(global_step, epoch, step_in_epoch, metrics, num_tokens=num_tokens)

    # -- clean-up -------------------------------------------------------------------------
    after_step.close()
    if dist_info.is_main:
        print(f"finished at step {global_step}; outputs in {args.output_dir}", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    recipe_main(main, ARGS)
