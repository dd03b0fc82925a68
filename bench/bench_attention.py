"""Attention kernels at sequence 2048: the dense-mask path against sdpa and flex (issue 17).

Run (one process):

    python bench/bench_attention.py                 # seq 2048, d 1024, 16 heads, 4 K/V heads
    python bench/bench_attention.py --seq-len 256   # a smoke size

One ``Attention`` layer (the model's own module, fp32 on CPU, bf16 on CUDA) runs forward and
backward on one row per backend, through the ``AttentionMask`` the decoder passes it:

- unpacked: one document per row (plain causal attention);
- packed: the row holds documents of 300-700 tokens (document-causal attention).

``dense`` is the former path (a ``[batch, seq, seq]`` mask, K/V heads repeated for GQA);
``sdpa`` is ``auto`` on CPU (``is_causal`` for unpacked rows, the mask with ``enable_gqa``
for packed ones); ``flex`` is ``auto`` on CUDA (compiled ``flex_attention`` and a block mask
built from the documents). torch 2.13 has no FlexAttention backward on CPU, so on CPU the
flex rows time the forward only (eager, the unfused debug path), against dense's forward.
Figures: the median seconds of ``--repeats`` runs after one warm-up (the two backends of a
row alternate run by run), and the peak memory
growth of one run, mask building included (the peak RSS on CPU, ``max_memory_allocated`` on
CUDA). Target: the ``auto`` backend is at least as fast as dense.
"""

import argparse
import time
import warnings

import torch

from _common import MiB, Row, median, parse_bench_args, print_table, seconds
from _system import PeakRSS
from tunelab.modules import Attention
from tunelab.modules.attention import resolve_attention_backend
from tunelab.modules.masks import AttentionMask
from tunelab.modules.rotary import RotaryEmbedding


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="unused (run_all.py passes a scratch dir)")
    return parse_bench_args(parser, smoke=["--seq-len", "256", "--dim", "256", "--repeats", "1"])


def document_ids(seq_len: int) -> torch.Tensor:
    """One row of documents of 300-700 tokens (the last one cut to fit)."""
    lengths, total = [], 0
    generator = torch.Generator().manual_seed(0)
    while total < seq_len:
        lengths.append(
            min(int(torch.randint(300, 701, (1,), generator=generator)), seq_len - total)
        )
        total += lengths[-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


def measure(
    layer: Attention, x: torch.Tensor, rotary: tuple, backends: tuple, packed_ids, backward: bool
) -> list[dict]:
    """Median seconds of one step per backend (mask built inside, as every forward does),
    the backends alternating run by run so load bursts hit them alike, and each one's peak."""
    cuda = x.device.type == "cuda"
    seq_len = x.shape[1]

    def step(backend: str) -> None:
        mask = AttentionMask(1, seq_len, x.device, backend, packed_ids).prepare()
        out = layer(x, *rotary, mask)
        if backward:
            out.float().square().mean().backward()
            x.grad = None
            layer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    results = []
    with torch.enable_grad() if backward else torch.no_grad():
        for backend in backends:
            step(backend)  # warm-up (and the compile on CUDA)
        times = {backend: [] for backend in backends}
        for _ in range(args.repeats):
            for backend in backends:
                start = time.perf_counter()
                step(backend)
                times[backend].append(time.perf_counter() - start)
        for backend in backends:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step(backend)
                peak = torch.cuda.max_memory_allocated() - base
            else:
                with PeakRSS() as rss:
                    step(backend)
                peak = rss.peak_growth
            results.append({"seconds": median(times[backend]), "peak": peak})
    return results


def main() -> None:
    """Time every (rows, backend) pair and print the table."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    head_dim = args.dim // args.heads
    layer = Attention(args.dim, args.heads, args.kv_heads, head_dim).to(device, dtype)
    x = torch.randn(1, args.seq_len, args.dim, device=device, dtype=dtype, requires_grad=True)
    ids = document_ids(args.seq_len).to(device)
    positions = torch.arange(args.seq_len, device=device)[None]
    rotary = RotaryEmbedding(head_dim, 10000.0).to(device)(positions, dtype)
    auto = resolve_attention_backend("auto", device)
    flex_backward = device.type == "cuda"
    rows, notes = [], []
    for packed in (False, True):
        label = "packed" if packed else "unpacked"
        pairs = [(auto, True)]
        if auto != "flex" and packed:  # unpacked rows take is_causal under flex too
            pairs.append(("flex", flex_backward))
        for backend, backward in pairs:
            new, old = measure(
                layer, x, rotary, (backend, "dense"), ids if packed else None, backward
            )
            ratio = new["seconds"] / old["seconds"]
            is_auto = backend == auto
            rows.append(
                Row(
                    f"{label}, {backend}{' (auto)' if is_auto else ''}, "
                    f"{'fwd+bwd' if backward else 'fwd only'}",
                    seconds(new["seconds"]),
                    f"dense {seconds(old['seconds'])}",
                    f"{ratio:.2f}x",
                    "<= 1.0x" if is_auto else "-",
                    ratio <= 1.0 if is_auto else None,
                    (f"{new['peak'] / MiB:.0f} MiB", f"{old['peak'] / MiB:.0f} MiB"),
                )
            )
    notes.append(
        f"One Attention layer, seq {args.seq_len}, dim {args.dim}, {args.heads} heads, "
        f"{args.kv_heads} K/V heads, batch 1, {str(dtype).removeprefix('torch.')} on "
        f"{device.type}; packed row: {int(ids.max()) + 1} documents; median of "
        f"{args.repeats} runs after a warm-up."
    )
    print_table(
        "Attention kernels (issue 17)",
        rows,
        notes,
        extra_columns=("peak memory", "peak memory, dense"),
    )


if __name__ == "__main__":
    # Eager flex_attention (CPU) warns that it is the unfused debug path: the path timed here.
    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    args = parse_args()
    main()
