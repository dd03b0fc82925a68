"""Model FLOPs of LoRA training steps, and the peak matmul FLOP/s of this machine.

Model FLOPs utilisation (MFU, Chowdhery et al. 2022, "PaLM", appendix B) is the FLOP/s the
model's arithmetic needs at the measured throughput, divided by the peak FLOP/s of the
hardware. Recomputation (activation checkpointing) and framework overhead do not count as
model FLOPs. Per processed token, with ``N`` the weights of the matmuls (every projection of
every block and ``lm_head``; the embedding is a lookup, not a matmul):

- full fine-tuning: forward ``2N``, backward ``4N`` (activation gradients ``2N`` and weight
  gradients ``2N``): the usual ``6N``;
- LoRA: the frozen base needs activation gradients but no weight gradients, so the base
  costs ``2N + 2N = 4N``; each adapter ``x A^T B^T`` (``A: r x in``, ``B: out x r``) costs
  ``6 N_a`` with ``N_a = r (in + out)`` its weights, which all train;
- attention scores and their weighting (no weights): forward ``4 d_attn T`` per layer and
  token for a context of ``T`` keys, halved for a causal mask (``2 d_attn T``); backward
  twice the forward, needed in LoRA too (activation gradients);
- DPO adds the reference forward (adapters off): ``2N + 2 L d_attn T`` per token;
- ``lm_head`` counts only at scored positions (``scored_fraction`` of them: all but the last
  for SFT on every token, the completion half of a DPO row): the logits of a prompt
  position feed no loss, so computing them is framework overhead, not model arithmetic.
"""

import time

import torch

from _common import barrier
from tunelab.models import ModelArgs


def base_matmul_params(args: ModelArgs, scored_fraction: float = 1.0) -> float:
    """``N``: weights of every projection of the blocks, plus ``lm_head`` where scored."""
    attn_dim = args.num_heads * args.head_dim
    kv_dim = args.num_kv_heads * args.head_dim
    per_layer = (
        args.dim * attn_dim  # q_proj
        + 2 * args.dim * kv_dim  # k_proj, v_proj
        + attn_dim * args.dim  # o_proj
        + 3 * args.dim * args.intermediate_dim  # gate_proj, up_proj, down_proj
    )
    return args.num_layers * per_layer + scored_fraction * args.vocab_size * args.dim


def attention_forward_flops(args: ModelArgs, seq_len: int) -> float:
    """Causal attention forward FLOPs per token: ``2 L d_attn T`` (half of ``4 L d_attn T``)."""
    return 2.0 * args.num_layers * args.num_heads * args.head_dim * seq_len


def lora_sft_flops_per_token(
    args: ModelArgs, adapter_params: int, seq_len: int, scored_fraction: float = 1.0
) -> float:
    """``4N + 6 N_a + 3 * attention forward``: one LoRA SFT token, forward and backward."""
    attention = attention_forward_flops(args, seq_len)
    base = base_matmul_params(args, scored_fraction)
    return 4.0 * base + 6.0 * adapter_params + 3.0 * attention


def lora_dpo_flops_per_token(
    args: ModelArgs, adapter_params: int, seq_len: int, scored_fraction: float = 1.0
) -> float:
    """LoRA SFT's cost per token plus the reference forward ``2N + attention forward``."""
    base = base_matmul_params(args, scored_fraction)
    reference = 2.0 * base + attention_forward_flops(args, seq_len)
    return lora_sft_flops_per_token(args, adapter_params, seq_len, scored_fraction) + reference


def peak_matmul_flops(size: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of a ``size x size`` fp32 ``torch.mm`` in this process.

    Every rank measures at the same time (barriers around each product), so the sum over
    ranks is the machine's peak for this layout of processes and threads.

    Args:
        size: Matrix side.
        repeats: Products timed; the fastest counts.

    Returns:
        FLOP/s (``2 size^3`` FLOPs per product).
    """
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    out = torch.mm(a, b)  # warm-up: threads, caches
    best = float("inf")
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    barrier()
    return 2.0 * size**3 / best
