"""GPU smoke: the pieces of the planned vLLM rollout engine (docs/vllm.md), on the tiny model.

    python bench/gpu_vllm_engine.py        # bench/gpu_smoke.sh runs it as the vllm_engine step

Checks, fp32, one GPU: (1) vLLM samples the same tokens twice from token-id prompts with
per-request seeds; (2) colocated sleep (level 2) and wake (weights, then KV cache) around a push
of LoRA-merged weights (tunelab's merge, Hugging Face names, in buckets through
``load_weights``), then ``reset_prefix_cache``; (3) vLLM's greedy completions on the pushed
weights equal tunelab's built-in engine's on the same adapted model (the first differing token
is printed otherwise). Prints the push's seconds. Without vllm it says so and exits 0 (a skip).
"""

import importlib.util
import os
import sys
import time
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "framework" / "tunelab" / "assets" / "tiny"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BUCKET_BYTES = 64 * 2**20


def main() -> int:
    """Run the checks; the exit status is the number that failed."""
    if importlib.util.find_spec("vllm") is None:
        print("vllm_engine: SKIPPED: vllm is not importable here (install it on a CUDA machine)")
        return 0
    # The engine core in this process, so that its model (and load_weights) is reachable.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    import tunelab.peft as peft
    from tunelab.config.lora import LoRAArgs
    from tunelab.peft.merge import merged_state_dict
    from tunelab.rl import ModelRolloutEngine, SamplingSettings
    from tunelab.training import load_model

    device = torch.device("cuda")
    torch.manual_seed(0)
    lora = LoRAArgs(rank=8, alpha=16.0, dropout=0.0, targets=TARGETS)
    model = load_model(str(TINY), device=device, dtype=torch.float32, lora=lora)
    for name, param in peft.get_adapter_params(model).items():
        if "lora_B" in name:  # fresh adapters are zero: make the update visible
            param.data.normal_(0.0, 0.05)
    prompts = torch.randint(3, 800, (8, 12), generator=torch.Generator().manual_seed(0)).tolist()
    new_tokens = 16

    llm = LLM(model=str(TINY), dtype="float32", enable_sleep_mode=True, enforce_eager=True,
              gpu_memory_utilization=0.3, max_model_len=512, seed=0)  # fmt: skip
    requests = [{"prompt_token_ids": p} for p in prompts]

    def sample(seed_base: int, temperature: float) -> list[list[int]]:
        params = [
            SamplingParams(
                n=1,
                seed=seed_base + i,
                temperature=temperature,
                max_tokens=new_tokens,
                ignore_eos=True,
            )  # fmt: skip
            for i in range(len(prompts))
        ]
        outputs = llm.generate(requests, sampling_params=params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    failures = 0
    first, again = sample(100, 1.0), sample(100, 1.0)
    same = first == again
    print(f"vllm_engine: per-request seeds, the same tokens twice: {same}")
    failures += not same

    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    start = time.perf_counter()
    hf_state = model.state_dict_adapter.to_hf(merged_state_dict(model))
    runner_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    bucket, size = [], 0
    for key, tensor in hf_state.items():
        bucket.append((key, tensor.detach()))
        size += tensor.numel() * tensor.element_size()
        if size >= BUCKET_BYTES:
            runner_model.load_weights(bucket)
            bucket, size = [], 0
    if bucket:
        runner_model.load_weights(bucket)
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    print(
        f"vllm_engine: pushed {len(hf_state)} merged tensors in {time.perf_counter() - start:.3f} s"
    )
    llm.wake_up(tags=["kv_cache"])

    theirs = sample(0, 0.0)
    engine = ModelRolloutEngine(
        model, SamplingSettings(max_new_tokens=new_tokens, temperature=0.0), pad_id=2
    )
    ours = engine.generate(prompts, list(range(len(prompts))))
    differing = [
        (row, next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), None))
        for row, (o, t) in enumerate(zip(ours, theirs))
        if o != t
    ]
    print(f"vllm_engine: greedy on the pushed weights equals the built-in engine: {not differing}"
          + (f" (rows, first differing token: {differing})" if differing else ""))  # fmt: skip
    failures += bool(differing)
    llm.sleep(level=2)
    return failures


if __name__ == "__main__":
    sys.exit(main())
