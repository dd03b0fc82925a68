"""LoRA export without a rank-0 gather vs the gather-on-rank-0 export it replaces.

Run (it starts its own 2 processes under torchrun):

    python bench/bench_export.py                # ~256 MB of fp32 base weights
    python bench/bench_export.py --size-mb 1100

A Llama-style LoRA model (adapters on every linear layer but ``lm_head``, trained B != 0)
is built with the recipes' ``build_model`` and sharded with FSDP2 on 2 ranks. Each
repetition exports it in Hugging Face format both ways, barrier to barrier:

- tunelab: ``CheckpointClient.export(epoch)``: the PEFT adapter (gathered: it is small),
  the shard-local out-of-place merge, every rank writing its rows straight into the final
  safetensors files, the finish step writing headers and the index (fsync on);
- the old path: ``full_tensor()`` of every state-dict entry (an all-gather; rank 0 keeps
  them), the adapter and the merge ``W + scale * B @ A`` on rank 0, then
  ``safetensors.torch.save_file`` of each output file from rank 0 (fsync on, same files).

Peak memory is the growth of each rank's peak resident set size during the export over its
resident size just before (``VmHWM`` reset through ``/proc/self/clear_refs``; see
``_common.PeakRSS``). The model's own shards were resident before and are not counted.
Targets: >= 3x faster; tunelab's largest per-rank peak <= half of rank 0's in the old path.
"""

import argparse
import json
import shutil
from pathlib import Path

from _launch import relaunch_under_torchrun

if __name__ == "__main__":  # before the imports below: this process only relaunches
    relaunch_under_torchrun(2)

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

import tunelab.peft as peft
from _common import (
    Row,
    barrier,
    gather_floats,
    is_main,
    mebibytes,
    median,
    print_table,
    seconds,
    time_collective,
)
from _models import (
    SMOKE_SIZE,
    build_model,
    parse_size_args,
    prepare_workspace,
    size_parser,
)
from _system import PeakRSS
from tunelab._fs import fsync_path
from tunelab.checkpoint import CheckpointClient, HFCheckpointReader, copy_model_files
from tunelab.config.lora import LoRAArgs
from tunelab.distributed import init_distributed
from tunelab.distributed._fqn import clean_fqn
from tunelab.peft.apply import lora_modules
from tunelab.peft.merge import merge_weight

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    parser = size_parser(__doc__.splitlines()[0], repeats=7, full=False)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    return parse_size_args(parser, smoke=(*SMOKE_SIZE, "--rank", "4"))


def gather_merge_save(model, lora: LoRAArgs, base: Path, out: Path) -> None:
    """The export tunelab replaces: gather everything on rank 0, merge there, write there."""
    rank = dist.get_rank()
    full = {}
    for key, value in model.state_dict().items():
        tensor = value.full_tensor() if isinstance(value, DTensor) else value.detach()
        if rank == 0:
            full[clean_fqn(key)] = tensor
        del tensor  # the other ranks drop each gathered tensor at once
    if rank != 0:
        return
    adapter = {key: value for key, value in full.items() if ".lora_" in key}
    peft.save_peft_adapter(
        adapter, lora.peft_config(peft.lora_target_names(model), str(base)), out / "adapter"
    )
    merged = {}
    for name, module in lora_modules(model).items():
        owner = clean_fqn(name)
        weight = full[f"{owner}.weight"]
        lora_a, lora_b = full.pop(f"{owner}.lora_A.weight"), full.pop(f"{owner}.lora_B.weight")
        merged[f"{owner}.weight"] = merge_weight(weight, lora_a, lora_b, module.scale)
    full.update(merged)
    hf = model.state_dict_adapter.to_hf(full)
    fqn_to_file = HFCheckpointReader(base).fqn_to_file
    files: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in hf.items():
        files.setdefault(fqn_to_file[key], {})[key] = tensor.contiguous()
    for name, tensors in files.items():
        save_file(tensors, out / name, metadata={"format": "pt"})
        fsync_path(out / name)
    index = {"metadata": {}, "weight_map": {key: fqn_to_file[key] for key in sorted(hf)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    copy_model_files(base, out, torch.float32)


def main() -> None:
    """Build the LoRA model, time both exports with their memory, print the table on rank 0."""
    args = parse_args()
    init_distributed("cpu")
    workspace = prepare_workspace(args, "tunelab_bench_export")
    root, base, out = workspace.root, workspace.base, workspace.out
    lora_args = LoRAArgs(rank=args.rank, alpha=2.0 * args.rank, targets=TARGETS)
    model = build_model(base, lora=lora_args)
    with torch.no_grad():  # a trained adapter: B != 0, so the merge changes every weight
        for param in peft.get_adapter_params(model).values():
            local = param.to_local() if isinstance(param, DTensor) else param
            local.normal_(0.0, 0.01)
    lora = LoRAArgs(rank=args.rank, alpha=2.0 * args.rank, targets=list(TARGETS))
    optimizer = torch.optim.AdamW(peft.get_adapter_params(model).values(), lr=1e-4)
    client = CheckpointClient(
        out,
        model=model,
        optimizer=optimizer,
        lr_scheduler=None,
        base_checkpoint_dir=base,
        lora=lora,
    )
    old_out = out / "gathered"

    def run(name: str) -> tuple[float, float]:
        if is_main():
            old_out.mkdir(parents=True, exist_ok=True)
        with PeakRSS() as memory:
            if name == "tunelab":
                elapsed = time_collective(lambda: client.export(0))
            else:
                elapsed = time_collective(lambda: gather_merge_save(model, lora, base, old_out))
        barrier()
        if is_main():
            shutil.rmtree(old_out if name == "old" else out / "epoch_0", ignore_errors=True)
        return elapsed, memory.peak_growth

    run("tunelab")  # warm-up: imports, first-call costs
    run("old")
    times: dict[str, list[float]] = {"tunelab": [], "old": []}
    peaks: dict[str, list[float]] = {"tunelab": [], "old": []}
    for _ in range(args.repeats):
        for name in times:  # interleaved, so load from other processes hits both alike
            elapsed, peak = run(name)
            times[name].append(elapsed)
            peaks[name].append(peak)
    # Diagnostic: the adapter gathered one tensor at a time, as export_hf does (latency-bound).
    adapter = peft.adapter_state_dict(model)
    gather_s = median(
        time_collective(lambda: [t.full_tensor() for t in adapter.values()])
        for _ in range(args.repeats)
    )
    # Per rank, the largest peak over repetitions; then every rank's, in rank order.
    new_peaks = gather_floats(max(peaks["tunelab"]))
    old_peaks = gather_floats(max(peaks["old"]))
    client.close()
    if is_main():
        shutil.rmtree(root, ignore_errors=True)
        t_new, t_old = median(times["tunelab"]), median(times["old"])
        new_max = max(new_peaks)
        rows = [
            Row("export time", seconds(t_new), seconds(t_old), f"{t_old / t_new:.2f}x faster",
                ">= 3x faster", t_old / t_new >= 3.0),
            Row("peak RSS growth, largest rank (vs old rank 0)", mebibytes(new_max),
                mebibytes(old_peaks[0]), f"{new_max / old_peaks[0]:.2f}",
                "<= 0.5 of old rank 0", new_max <= 0.5 * old_peaks[0]),
        ]  # fmt: skip
        for rank, (new, old) in enumerate(zip(new_peaks, old_peaks, strict=True)):
            rows.append(Row(f"peak RSS growth, rank {rank}", mebibytes(new), mebibytes(old),
                            f"{new / max(old, 1):.2f}", "-", None))  # fmt: skip
        print_table(
            "LoRA export: shard-local merge + parallel write vs gather on rank 0",
            rows,
            [
                f"{workspace.weight_bytes / 1e9:.2f} GB fp32 base weights, LoRA r={args.rank} on "
                f"{', '.join(TARGETS)}; {dist.get_world_size()} ranks, fsync on in both, "
                f"median of {args.repeats} (times), max of {args.repeats} (memory); "
                "tunelab times: " + ", ".join(f"{t:.3f}" for t in times["tunelab"]) + " s; "
                "old: " + ", ".join(f"{t:.3f}" for t in times["old"]) + " s",
                f"diagnostic: gathering the {len(adapter)} adapter tensors one all-gather each "
                f"takes {gather_s:.3f} s (export_hf gathers them in one collective instead)",
            ],
        )
    dist.barrier()  # rank 0 prints first; tear down only once all ranks are done
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
