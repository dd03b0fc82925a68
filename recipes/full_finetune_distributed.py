"""Full fine-tuning of a decoder LLM on 1..N processes (FSDP2 over torchrun).

Launch: ``tunelab run --nproc_per_node 2 full_finetune_distributed --config tiny/full``.
Copy it to customise: ``tunelab cp full_finetune_distributed my_full.py``.

Reads top to bottom: set-up, resume, the training loop, exports, clean-up.
"""

import time

from tunelab.checkpoint import CheckpointClient
from tunelab.config import instantiate, recipe_main
from tunelab.config.recipe_args import FullFinetuneArgs
from tunelab.data import padded_collate_sft
from tunelab.distributed import destroy_distributed, init_distributed, resolve_dtype
from tunelab.training import ProgressBar, seed_everything
from tunelab.training.loop import (
    evaluate,
    optimizer_step,
    peak_memory_gib,
    sft_backward,
    to_device,
)
from tunelab.training.setup import build_dataloader, build_model, config_fingerprint

ARGS = FullFinetuneArgs


def main(args: FullFinetuneArgs) -> None:
    """Train every weight on ``args.dataset`` and export the model."""
    # -- set-up: the process group first, everything else after it -------------------------
    dist_info = init_distributed(args.device)
    device = dist_info.device
    seed_everything(args.seed)
    tokenizer = instantiate(args.tokenizer)
    model = build_model(
        args.checkpoint_dir,
        device=device,
        dtype=resolve_dtype(args.dtype),
        activation_checkpointing=args.enable_activation_checkpointing,
        compile_blocks=args.compile,
        reshard_after_forward=args.reshard_after_forward,
        mixed_precision=args.mixed_precision,
        seed=args.seed,
    )
    dataset = instantiate(args.dataset, tokenizer=tokenizer)
    loader, sampler = build_dataloader(
        dataset,
        batch_size=args.batch_size,
        collate_fn=padded_collate_sft,
        seed=args.seed,
        pad_id=tokenizer.pad_id,
    )
    val_loader = None
    if args.val_dataset is not None:
        val_dataset = instantiate(args.val_dataset, tokenizer=tokenizer)
        val_loader, _ = build_dataloader(
            val_dataset,
            batch_size=args.batch_size,
            collate_fn=padded_collate_sft,
            seed=args.seed,
            shuffle=False,
            pad_id=tokenizer.pad_id,
        )
    steps_per_epoch = len(loader) // args.gradient_accumulation_steps
    if args.max_steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, args.max_steps_per_epoch)
    trainable = list(model.parameters())
    optimizer = instantiate(args.optimizer, params=trainable)
    lr_scheduler = None
    if args.lr_scheduler is not None:
        lr_scheduler = instantiate(
            args.lr_scheduler,
            optimizer=optimizer,
            num_training_steps=steps_per_epoch * args.epochs,
        )
    loss_fn = instantiate(args.loss)
    loggers = [instantiate(node) for node in args.metric_loggers] if dist_info.is_main else []
    checkpoints = CheckpointClient(
        args.output_dir,
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        base_checkpoint_dir=args.checkpoint_dir,
        enable_async=args.checkpoint.enable_async_checkpointing,
        keep_last_n=args.checkpoint.keep_last_n_checkpoints,
        config_hash=config_fingerprint(args),
    )

    # -- resume ---------------------------------------------------------------------------
    global_step, start_epoch = 0, 0
    if args.checkpoint.resume_from_checkpoint:
        resumed = checkpoints.load_latest()
        if resumed is not None:
            global_step, start_epoch = resumed.step, resumed.epoch
            sampler.load_state_dict(resumed.progress["sampler"])
            if resumed.progress["epoch_done"]:
                start_epoch += 1

    # -- train ----------------------------------------------------------------------------
    progress = ProgressBar(
        steps_per_epoch * args.epochs, initial=global_step, enabled=dist_info.is_main
    )
    model.train()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        batches = iter(loader)
        step_in_epoch = sampler.consumed // sampler.samples_per_step(
            args.batch_size * args.gradient_accumulation_steps
        )
        while step_in_epoch < steps_per_epoch:
            start = time.perf_counter()
            micro_batches = [
                to_device(next(batches), device) for _ in range(args.gradient_accumulation_steps)
            ]
            loss, num_tokens = sft_backward(model, loss_fn, micro_batches, dist_info.world_size)
            metrics = optimizer_step(
                optimizer,
                trainable,
                clip_grad_norm=args.clip_grad_norm,
                lr_scheduler=lr_scheduler,
            )
            sampler.advance(args.batch_size * args.gradient_accumulation_steps)
            global_step += 1
            step_in_epoch += 1

            tokens_per_second = num_tokens / (time.perf_counter() - start)
            progress.update(loss=loss, lr=metrics["lr"], tokens_per_second=tokens_per_second)
            if global_step % args.log_every_n_steps == 0:
                metrics.update(
                    loss=loss,
                    tokens_per_second=tokens_per_second,
                    peak_memory_gib=peak_memory_gib(device),
                )
                for logger in loggers:
                    logger.log(metrics, global_step)
            epoch_done = step_in_epoch == steps_per_epoch
            if val_loader is not None and (
                epoch_done or _every(global_step, args.run_val_every_n_steps)
            ):
                val_loss = evaluate(model, val_loader, loss_fn, device)
                for logger in loggers:
                    logger.log({"val_loss": val_loss}, global_step)
            if epoch_done and (
                epoch == args.epochs - 1 or _every(epoch + 1, args.checkpoint.export_every_n_epochs)
            ):
                checkpoints.export(epoch)
            if epoch_done or _every(global_step, args.checkpoint.save_every_n_steps):
                progress_record = {"sampler": sampler.state_dict(), "epoch_done": epoch_done}
                last = epoch_done and epoch == args.epochs - 1
                # Nothing is left to overlap the run's last save with: write it synchronously.
                checkpoints.save(global_step, epoch, progress_record, blocking=last)

    # -- clean-up -------------------------------------------------------------------------
    progress.close()
    checkpoints.close()
    for logger in loggers:
        logger.close()
    if dist_info.is_main:
        print(f"finished at step {global_step}; outputs in {args.output_dir}", flush=True)
    destroy_distributed()


def _every(count: int, interval: int | None) -> bool:
    return bool(interval) and count % interval == 0


if __name__ == "__main__":
    recipe_main(main, ARGS)
