"""LoRA fine-tuning of a decoder LLM on 1..N processes (FSDP2 over torchrun).

Launch: ``tunelab run --nproc_per_node 2 lora_finetune_distributed --config tiny/lora``.
Copy it to customise: ``tunelab cp lora_finetune_distributed my_lora.py``.

Reads top to bottom: set-up, resume, the training loop (each optimizer step: forward, loss and
backward over its micro-batches, then clip and step, log, validate, export, save), clean-up.
"""

import time

import torch

import tunelab.peft as peft
from tunelab.config import LoRAFinetuneArgs, instantiate, recipe_main
from tunelab.data import padded_collate_sft
from tunelab.distributed import (
    all_reduce_sum,
    data_parallel_mesh,
    destroy_distributed,
    init_distributed,
    resolve_dtype,
)
from tunelab.lifecycle import Preemption, lock_output_dir
from tunelab.training import (
    MetricLoggers,
    NonFiniteGuard,
    ProgressBar,
    Schedule,
    StepProfiler,
    batch_loss,
    build_checkpoint_client,
    build_data,
    build_model,
    build_optimizer,
    evaluate,
    global_token_count,
    optimizer_step,
    output_layer,
    peak_memory_gib,
    progress_record,
    resume,
    seed_everything,
    to_device,
)

ARGS = LoRAFinetuneArgs


def main(args: LoRAFinetuneArgs) -> None:
    """Train LoRA adapters on ``args.dataset`` and export adapter and merged model."""
    # -- set-up: the process group first, everything else after it -------------------------
    dist_info = init_distributed(args.device, collective_timeout_s=args.collective_timeout_s)
    # One run per output_dir: a second one stops here, before loading or writing anything.
    lock_output_dir(args.output_dir)
    device = dist_info.device
    seed_everything(args.seed)
    tokenizer = instantiate(args.tokenizer)
    # HSDP when data_parallel_replicate_size > 1: shard within a node, replicate across nodes.
    mesh = data_parallel_mesh(
        device,
        replicate_size=args.data_parallel_replicate_size,
        shard_size=args.data_parallel_shard_size,
    )
    model = build_model(
        args.checkpoint_dir,
        device=device,
        mesh=mesh,
        dtype=resolve_dtype(args.dtype),
        lora=args.lora,
        adapter_dir=args.adapter_dir,
        activation_checkpointing=args.enable_activation_checkpointing,
        compile_blocks=args.compile,
        attention_backend=args.attention_backend,
        reshard_after_forward=args.reshard_after_forward,
        mixed_precision=args.mixed_precision,
        seed=args.seed,
        frozen_base=args.frozen_base,
    )
    data = build_data(args, tokenizer, padded_collate_sft)
    trainable = list(peft.get_adapter_params(model).values())
    optimizer, lr_scheduler = build_optimizer(args, trainable, data.steps_per_epoch * args.epochs)
    loss_fn = instantiate(args.loss)
    # The loss applies the output layer chunk by chunk: the logits never exist whole.
    output = output_layer(model) if args.chunked_output else None
    loggers = MetricLoggers(args.metric_loggers, enabled=dist_info.is_main)
    checkpoints = build_checkpoint_client(args, model, optimizer, lr_scheduler, tokenizer)
    schedule = Schedule(args)
    nonfinite = NonFiniteGuard(args.skip_nonfinite_steps)

    # -- resume ---------------------------------------------------------------------------
    global_step, start_epoch = resume(args, checkpoints, data)
    loggers.start_at(global_step)

    # -- train ----------------------------------------------------------------------------
    progress = ProgressBar(
        data.steps_per_epoch * args.epochs, initial=global_step, enabled=dist_info.is_main
    )
    profiler = StepProfiler(
        args.output_dir,
        enabled=args.profile,
        skip_first=args.profile_skip_first,
        record_steps=args.profile_record_steps,
    )
    # From here a SIGTERM or SIGINT stops the run at the end of a step, with a checkpoint.
    preemption = Preemption(checkpoints, close=(progress, loggers))
    model.train()
    for epoch in range(start_epoch, args.epochs):
        data.sampler.set_epoch(epoch)
        batches = iter(data.loader)
        step_in_epoch = data.step_in_epoch(args)
        while step_in_epoch < data.steps_per_epoch:
            start = time.perf_counter()
            micro_batches = [
                to_device(next(batches), device) for _ in range(args.gradient_accumulation_steps)
            ]
            # The step's loss: token losses summed over micro-batches and ranks, divided by their
            # number of target tokens, so every token weighs the same at any world size.
            num_tokens = global_token_count(micro_batches)
            total_loss = torch.zeros((), dtype=torch.float64, device=device)
            for batch in micro_batches:
                loss_sum, _ = batch_loss(loss_fn, model, batch, output)
                # FSDP2 averages gradients over ranks: scale by the world size to get a global sum.
                (loss_sum * dist_info.world_size / num_tokens).backward()
                total_loss += loss_sum.detach()
            loss = (all_reduce_sum(total_loss) / num_tokens).item()
            metrics = optimizer_step(
                optimizer,
                trainable,
                clip_grad_norm=args.clip_grad_norm,
                lr_scheduler=lr_scheduler,
                guard=nonfinite,  # a NaN/inf loss or gradient stops the run before the update
                loss=loss,
                step=global_step + 1,
            )
            profiler.step()
            data.sampler.advance(args.batch_size * args.gradient_accumulation_steps)
            global_step += 1
            step_in_epoch += 1

            tokens_per_second = num_tokens.item() / (time.perf_counter() - start)
            progress.update(loss=loss, lr=metrics["lr"], tokens_per_second=tokens_per_second)
            if schedule.log(global_step):
                metrics.update(
                    loss=loss,
                    tokens_per_second=tokens_per_second,
                    peak_memory_gib=peak_memory_gib(device),
                )
                loggers.log(metrics, global_step)
            epoch_done = step_in_epoch == data.steps_per_epoch
            if data.val_loader is not None and schedule.validate(global_step, epoch_done):
                val_loss = evaluate(model, data.val_loader, loss_fn, device, output)
                loggers.log({"val_loss": val_loss}, global_step)
            if schedule.export(epoch, epoch_done):
                checkpoints.export(epoch)
            if schedule.save(global_step, epoch_done):
                checkpoints.save(
                    global_step,
                    epoch,
                    progress_record(data, epoch_done),
                    # Nothing is left to overlap the run's last save with: write it in place.
                    blocking=schedule.is_last(epoch, epoch_done),
                )
            if preemption.stop_agreed():  # A collective: every rank asks once per step.
                preemption.stop(
                    global_step,
                    epoch,
                    progress_record(data, epoch_done),
                    saved=schedule.save(global_step, epoch_done),
                )

    # -- clean-up -------------------------------------------------------------------------
    progress.close()
    profiler.close()
    checkpoints.close()
    loggers.close()
    if dist_info.is_main:
        print(f"finished at step {global_step}; outputs in {args.output_dir}", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    recipe_main(main, ARGS)
