"""Driven by test_grpo_rollout_merge.py under torchrun: merged adapters in an FSDP2 rollout.

On a fresh FSDP2-sharded LoRA model with random ``lora_B`` (a fresh one is zero), it samples the
same prompts and seeds with the default engine (every group gathered on entry, the adapters
merged into the gathered weights) and with merging off, and prints one ``MERGE`` JSON line per
rank: how many layers merged, the LoRA layers, whether the completions are equal, whether every
sharded parameter is bit for bit what it was, and the all-gathers of the merged call.

Usage: rollout_merge_script.py
"""

import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

import tunelab.peft.inference_merge as inference_merge
from tunelab.config.lora import LoRAArgs
from tunelab.data import load_tokenizer, prompt_dataset
from tunelab.distributed import data_parallel_mesh, destroy_distributed, init_distributed
from tunelab.peft import LoRALinear, get_adapter_params
from tunelab.rl import ModelRolloutEngine, SamplingSettings, sampling_seeds
from tunelab.training import load_model

TINY = Path(__file__).resolve().parents[2] / "framework" / "tunelab" / "assets" / "tiny"
GATHER = re.compile(r"FSDP::all_gather( \(.*\))?")


def whole_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole value (a collective: a sharded one is all-gathered)."""
    return {
        name: (param.full_tensor() if isinstance(param, DTensor) else param.detach()).clone()
        for name, param in model.named_parameters()
    }


def main() -> None:
    info = init_distributed("cpu")
    tokenizer = load_tokenizer(str(TINY), max_seq_len=128)
    data = prompt_dataset(
        tokenizer, source="json", data_files=str(TINY / "grpo_prompts.jsonl"), template="instruct"
    )
    indices = [2 * info.rank, 2 * info.rank + 1]
    prompts = [data.tokens[index] for index in indices for _ in range(4)]
    seeds = sampling_seeds(0, 0, indices, 4)
    settings = SamplingSettings(
        max_new_tokens=12, temperature=1.0, stop_ids=frozenset(tokenizer.stop_ids)
    )
    torch.manual_seed(0)
    model = load_model(
        str(TINY),
        device=torch.device("cpu"),
        dtype=torch.float32,
        lora=LoRAArgs(rank=4, alpha=8.0, targets=["q_proj", "v_proj", "o_proj", "down_proj"]),
        mesh=data_parallel_mesh(torch.device("cpu")),
    )
    with torch.no_grad():
        for name, param in get_adapter_params(model).items():
            if "lora_B" in name:
                param.to_local().normal_(std=0.2)
    before = whole_values(model)
    counts = []
    merge_weight = inference_merge.merge_weight

    def counted(weight, *args):
        counts.append(isinstance(weight, DTensor))
        return merge_weight(weight, *args)

    inference_merge.merge_weight = counted
    merged = ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id)
    unmerged = ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id, merge_adapters=False)
    # The model's very first forward happens inside the merged call (FSDP2's lazy init).
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        first = merged.generate(prompts, seeds)
    gathers = [event.name for event in prof.events() if GATHER.fullmatch(event.name)]
    second = unmerged.generate(prompts, seeds)
    third = merged.generate(prompts, seeds)
    after = whole_values(model)
    report = {
        "rank": info.rank,
        "merged": len(counts),
        "merged_dtensors": sum(counts),
        "lora_layers": sum(isinstance(m, LoRALinear) for m in model.modules()),
        "groups": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "gathers": len(gathers),
        "equal": first == second == third,
        "tokens": sum(len(c) for c in first),
        "untouched": all(torch.equal(before[name], after[name]) for name in before),
        # The blocks' groups resharded (the root's frozen embedding may stay gathered).
        "sharded": all(isinstance(param, DTensor) for param in model.layers.parameters()),
        "no_merged_left": all(
            m.merged_weight is None for m in model.modules() if isinstance(m, LoRALinear)
        ),
    }
    for rank in range(info.world_size):  # one line at a time
        if rank == info.rank:
            # One write per line (atomic on a pipe): ranks' print() calls can interleave.
            os.write(1, ("MERGE " + json.dumps(report) + "\n").encode())
        dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
