"""bench_grpo's memory row: peak RSS of the log-prob pass, tunelab's chunked one against TRL's.

Forward and backward of the completion log-probs (what each side runs per micro-batch) of a
synthetic 2-layer model with a large vocabulary and one long completion, LoRA r=8. tunelab: the
chunked output layer at completion positions only (``completion_logps``); TRL: the model's
logits for the completion (``logits_to_keep``) and ``selective_log_softmax``, as
``GRPOTrainer`` computes them. Peak resident-set growth over the pass (``_system.PeakRSS``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from _grpo_work import TARGETS
from _system import PeakRSS

PROMPT_TOKENS = 64


def logps_batch(args: argparse.Namespace) -> torch.Tensor:
    """One row: a 64-token prompt and ``--logps-completion-tokens`` completion tokens."""
    generator = torch.Generator().manual_seed(0)
    length = PROMPT_TOKENS + args.logps_completion_tokens
    return torch.randint(3, args.logps_vocab_size, (1, length), generator=generator)


def tunelab_logps_peak(args: argparse.Namespace, base: Path) -> float:
    """Peak RSS growth of tunelab's chunked completion log-prob forward + backward."""
    from tunelab.config.lora import LoRAArgs
    from tunelab.rl import completion_logps, rollout_batch
    from tunelab.training import load_model, output_layer

    lora = LoRAArgs(rank=8, alpha=16.0, dropout=0.0, targets=TARGETS)
    model = load_model(str(base), device=torch.device("cpu"), dtype=torch.float32, lora=lora)
    row = logps_batch(args)[0].tolist()
    batch = rollout_batch([row[:PROMPT_TOKENS]], [row[PROMPT_TOKENS:]], 0, torch.device("cpu"))
    with PeakRSS() as memory:
        logps, mask = completion_logps(model, batch, output_layer(model))
        logps[mask].sum().backward()
    return memory.peak_growth


def trl_logps_peak(args: argparse.Namespace, base: Path) -> float:
    """Peak RSS growth of GRPOTrainer's way: the completion's logits, selective_log_softmax."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import selective_log_softmax

    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), lora
    )
    tokens = logps_batch(args)
    completion = tokens[:, PROMPT_TOKENS:]
    with PeakRSS() as memory:
        logits = model(input_ids=tokens, logits_to_keep=completion.shape[1] + 1).logits
        logps = selective_log_softmax(logits[:, :-1], completion)
        logps.sum().backward()
    return memory.peak_growth
