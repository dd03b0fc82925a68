"""Mixture-of-experts compute: grouped expert matmuls against a per-expert loop (issue 27).

Run (one process):

    python bench/bench_moe.py                      # 1024 tokens, dim 256, experts of 128
    python bench/bench_moe.py --smoke                   # its smallest sizes: checks it runs

tunelab's ``MoEBlock`` sorts the (token, expert) pairs by expert once per layer and runs each
projection as one grouped matmul (``grouped_mm`` where it has a kernel, which on CPU is fp32
and bf16 with 16-byte row strides; else one padded ``bmm``). The alternative is the
per-expert Python loop transformers 4.x runs (``Qwen3MoeSparseMoeBlock``/
``MixtralSparseMoeBlock``): a one-hot mask, then for each expert that got tokens, gather them,
three linears, scale and ``index_add_``. Both run the same weights and router, forward and
backward, on one MoE layer and on a tiny model (4 layers, all MoE), top-2 of 8 and of 32
experts. Figures: the median seconds of ``--repeats`` steps after a warm-up, the two paths
alternating step by step, each step forward and backward only; the results of the two agree
within 1e-5 (outputs and gradients, copied and checked before timing: until session 9 the
timed steps also copied every gradient, the same cost on both sides).
Target: the grouped path at least 2x faster at 32 experts.
"""

import argparse
import time
import types

import torch
import torch.nn.functional as F

from _common import Row, median, parse_bench_args, print_table, seconds
from tunelab.models import ModelArgs, TransformerDecoder
from tunelab.modules import MoEBlock, MoEExperts


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per step (batch 2)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--expert-dim", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4, help="layers of the tiny model")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="unused (run_all.py passes a scratch dir)")
    smoke = ["--tokens", "32", "--dim", "64", "--expert-dim", "32", "--layers", "1",
             "--repeats", "1"]  # fmt: skip
    return parse_bench_args(parser, smoke)


def loop_forward(
    self: MoEExperts, x: torch.Tensor, top_weights: torch.Tensor, top_indices: torch.Tensor
) -> torch.Tensor:
    """``MoEExperts.forward`` the transformers 4.x way: a Python loop over the experts."""
    out = torch.zeros_like(x)
    expert_mask = F.one_hot(top_indices, num_classes=self.num_experts).permute(2, 1, 0)
    for expert in range(self.num_experts):
        slot, token = torch.where(expert_mask[expert])
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
        hidden = F.linear(self.activation(gate) * up, self.down_proj[expert])
        out.index_add_(0, token, hidden * top_weights[token, slot, None].to(hidden.dtype))
    return out


def use_loop(module: torch.nn.Module, loop: bool) -> None:
    """Switch every ``MoEExperts`` in ``module`` to the loop (True) or the grouped path."""
    for child in module.modules():
        if isinstance(child, MoEExperts):
            if loop:
                child.forward = types.MethodType(loop_forward, child)
            else:
                child.__dict__.pop("forward", None)


def layer_case(num_experts: int):
    """One MoE layer and its input: ``(module, step)``."""
    torch.manual_seed(0)
    block = MoEBlock(
        args.dim, args.expert_dim, num_experts, args.top_k, normalize_top_k=True
    ).float()
    x = torch.randn(2, args.tokens // 2, args.dim, requires_grad=True)

    def step(collect: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = block(x)
        out.square().mean().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()] if collect else []
        x.grad = None
        block.zero_grad(set_to_none=True)
        return out.detach(), grads

    return block, step


def model_case(num_experts: int):
    """A tiny all-MoE model and a batch: ``(module, step)``."""
    torch.manual_seed(0)
    model_args = ModelArgs(
        vocab_size=512, dim=args.dim, num_layers=args.layers, num_heads=4, num_kv_heads=2,
        intermediate_dim=args.expert_dim, family="qwen3_moe", qk_norm=True,
        num_experts=num_experts, num_experts_per_tok=args.top_k,
        moe_intermediate_dim=args.expert_dim, norm_topk_prob=True,
    )  # fmt: skip
    model = TransformerDecoder(model_args)
    tokens = torch.randint(
        0, 512, (2, args.tokens // 2), generator=torch.Generator().manual_seed(1)
    )

    def step(collect: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits = model(tokens)
        logits.float().logsumexp(-1).mean().backward()
        grads = [p.grad.clone() for p in model.parameters()] if collect else []
        model.zero_grad(set_to_none=True)
        return logits.detach(), grads

    return model, step


def measure(module: torch.nn.Module, step) -> tuple[float, float, float]:
    """``(grouped seconds, loop seconds, largest difference of outputs and gradients)``."""
    use_loop(module, False)
    out, grads = step()
    use_loop(module, True)
    loop_out, loop_grads = step()
    error = max(float((a - b).abs().max()) for a, b in zip([out, *grads], [loop_out, *loop_grads]))
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for loop in (False, True):
            use_loop(module, loop)
            start = time.perf_counter()
            step(collect=False)  # forward + backward only (no copies of the gradients)
            times[loop].append(time.perf_counter() - start)
    use_loop(module, False)
    return median(times[False]), median(times[True]), error


def main() -> None:
    """Time both paths on each (case, experts) pair and print the table."""
    rows, notes = [], []
    errors = []
    for label, case in (("one layer", layer_case), ("tiny model", model_case)):
        for num_experts in (8, 32):
            module, step = case(num_experts)
            grouped, loop, error = measure(module, step)
            errors.append(error)
            ratio = loop / grouped
            has_target = num_experts == 32
            rows.append(
                Row(
                    f"{label}, top-{args.top_k} of {num_experts}, fwd+bwd",
                    seconds(grouped),
                    f"loop {seconds(loop)}",
                    f"{ratio:.2f}x",
                    ">= 2.0x" if has_target else "-",
                    (ratio >= 2.0 and error <= 1e-5) if has_target else None,
                    (f"{error:.1e}",),
                )
            )
    probe = MoEExperts(args.dim, args.expert_dim, 2)
    kernel = "grouped_mm" if probe_grouped(probe) else "padded bmm"
    notes.append(
        f"{args.tokens} tokens (batch 2), dim {args.dim}, experts of {args.expert_dim}, "
        f"fp32 on CPU ({torch.get_num_threads()} threads), grouped path: {kernel}; tiny model: {args.layers} MoE layers, vocab "
        f"512; ratio = loop time / grouped time; median of {args.repeats} steps after a "
        f"warm-up. Largest |difference| of outputs and gradients: {max(errors):.1e}."
    )
    print_table(
        "MoE experts: grouped matmuls vs a per-expert loop (issue 27)",
        rows,
        notes,
        extra_columns=("max |diff|",),
    )


def probe_grouped(experts: MoEExperts) -> bool:
    """Whether the grouped path runs ``grouped_mm`` for these shapes."""
    from tunelab.modules.moe import _grouped_mm_available

    rows = torch.zeros(4, experts.gate_up_proj.shape[-1])
    return _grouped_mm_available(rows, experts.gate_up_proj) and _grouped_mm_available(
        rows, experts.down_proj
    )


if __name__ == "__main__":
    args = parse_args()
    main()
