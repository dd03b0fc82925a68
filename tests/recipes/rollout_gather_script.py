"""Driven by test_grpo.py under torchrun: FSDP2 all-gathers of one rollout phase.

Generates the same completions with the parameters held gathered for the call
(``gather_once``), then gathered per forward, on a LoRA model (frozen base sharded) and a full
one, and prints one ``GATHERS`` JSON line per rank: the all-gathers each way (all, and of blocks) (counted from
FSDP2's own ``FSDP::all_gather`` profiler ranges, no patching), the number of FSDP2 groups,
the forwards of the phase and whether the completions are equal. Then, held, rank ``r`` samples
``MAX_NEW_TOKENS + 3 r`` tokens: the ranks run different numbers of decode forwards, which
only works (no hang) when a held forward runs no collective, and the line counts the
all-reduces of that call and of the per-forward one (where ranks must step together).

Usage: rollout_gather_script.py
"""

import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.profiler import ProfilerActivity, profile

from tunelab.config.lora import LoRAArgs
from tunelab.data import load_tokenizer, prompt_dataset
from tunelab.distributed import data_parallel_mesh, destroy_distributed, init_distributed
from tunelab.rl import ModelRolloutEngine, SamplingSettings, sampling_seeds
from tunelab.training import load_model

TINY = Path(__file__).resolve().parents[2] / "framework" / "tunelab" / "assets" / "tiny"
MAX_NEW_TOKENS = 6
GATHER = re.compile(r"FSDP::all_gather( \(.*\))?")


def all_gathers(engine: ModelRolloutEngine, prompts: list[list[int]], seeds: list[int]):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        completions = engine.generate(prompts, seeds)
    # One "FSDP::all_gather (<group>)" range per group all-gather (the root's has no name).
    names = [event.name for event in prof.events() if GATHER.fullmatch(event.name)]
    all_reduces = sum(event.name == "c10d::allreduce_" for event in prof.events())
    return completions, len(names), sum("layers." in name for name in names), all_reduces


def main() -> None:
    info = init_distributed("cpu")
    tokenizer = load_tokenizer(str(TINY), max_seq_len=128)
    data = prompt_dataset(
        tokenizer, source="json", data_files=str(TINY / "grpo_prompts.jsonl"), template="instruct"
    )
    indices = [2 * info.rank, 2 * info.rank + 1]  # each rank its own prompts, as in the recipe
    prompts = [data.tokens[index] for index in indices for _ in range(2)]
    seeds = sampling_seeds(0, 0, indices, 2)
    settings = SamplingSettings(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0)  # no stop
    report = {}
    for name, lora in (("lora", LoRAArgs(rank=4, alpha=8.0)), ("full", None)):
        model = load_model(
            str(TINY),
            device=torch.device("cpu"),
            dtype=torch.float32,
            lora=lora,
            mesh=data_parallel_mesh(torch.device("cpu")),
        )
        per_forward = ModelRolloutEngine(
            model, settings, pad_id=tokenizer.pad_id, gather_once=False
        )
        held = ModelRolloutEngine(model, settings, pad_id=tokenizer.pad_id)
        first, gathers_held, blocks_held, _ = all_gathers(held, prompts, seeds)
        second, gathers_per_forward, blocks_per_forward, reduces_per_forward = all_gathers(
            per_forward, prompts, seeds
        )
        uneven = SamplingSettings(max_new_tokens=MAX_NEW_TOKENS + 3 * info.rank, temperature=1.0)
        held_uneven = ModelRolloutEngine(model, uneven, pad_id=tokenizer.pad_id)
        third, _, _, reduces_uneven = all_gathers(held_uneven, prompts, seeds)
        report[name] = {
            "groups": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "layers": len(model.layers),
            "forwards": MAX_NEW_TOKENS,  # the prefill and MAX_NEW_TOKENS - 1 decode steps
            "held": gathers_held,
            "per_forward": gathers_per_forward,
            "held_blocks": blocks_held,
            "per_forward_blocks": blocks_per_forward,
            "equal": first == second,
            "per_forward_all_reduces": reduces_per_forward,
            "uneven_all_reduces": reduces_uneven,
            "uneven_lengths": sorted({len(c) for c in third}),
        }
    # One write per line (atomic on a pipe): two ranks' print() calls can interleave their
    # text and newline writes into one line.
    os.write(1, ("GATHERS " + json.dumps({"rank": info.rank, **report}) + "\n").encode())
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
