"""Time the GGUF export of a Llama-shaped model: tunelab's 2-rank export vs a raw write of its bytes.

Run (it relaunches itself under torchrun with 2 processes, gloo, CPU):

    python bench/bench_gguf.py --size-mb 512

A random fp32 Llama-shaped Hugging Face folder (the embedded tiny tokenizer, enough layers for
``--size-mb`` MB of f16 GGUF) is exported to f16 by ``export_gguf`` on both ranks, fsync on,
barrier to barrier; the baseline writes the same number of bytes, each rank half into its own
file, with fsync. Both are medians of ``--repeats`` after one untimed warm-up of each.
llama.cpp's ``convert_hf_to_gguf.py`` is not timed: it ships in the llama.cpp repository, not
in the ``gguf`` package or any registry package this project installs, so that row says no.
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from _common import (
    Row,
    parse_bench_args,
    print_table,
    relaunch_under_torchrun,
    seconds,
    time_collective,
)
from tunelab._paths import assets_dir
from tunelab.checkpoint.gguf_export import export_gguf

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 1024, 2816, 16, 4, 810


def build_model(folder: Path, size_mb: int) -> None:
    """A random fp32 Llama folder whose f16 weights take about ``size_mb`` MB."""
    head_dim = HIDDEN // HEADS
    per_layer = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * head_dim + 3 * HIDDEN * INTERMEDIATE
    layers = max(1, size_mb * 10**6 // (2 * per_layer))
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    state = {
        "model.embed_tokens.weight": weight(VOCAB, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN),
    }
    for i in range(layers):
        prefix = f"model.layers.{i}."
        state |= {
            prefix + "self_attn.q_proj.weight": weight(HIDDEN, HIDDEN),
            prefix + "self_attn.k_proj.weight": weight(KV_HEADS * head_dim, HIDDEN),
            prefix + "self_attn.v_proj.weight": weight(KV_HEADS * head_dim, HIDDEN),
            prefix + "self_attn.o_proj.weight": weight(HIDDEN, HIDDEN),
            prefix + "mlp.gate_proj.weight": weight(INTERMEDIATE, HIDDEN),
            prefix + "mlp.up_proj.weight": weight(INTERMEDIATE, HIDDEN),
            prefix + "mlp.down_proj.weight": weight(HIDDEN, INTERMEDIATE),
            prefix + "input_layernorm.weight": torch.ones(HIDDEN),
            prefix + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        }
    folder.mkdir(parents=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((assets_dir() / "tiny" / "config.json").read_text())
    config.update(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=head_dim, num_hidden_layers=layers)  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(assets_dir() / "tiny" / name, folder / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512, help="f16 GGUF size, MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    args = parse_bench_args(parser, smoke=["--size-mb", "8", "--repeats", "1"])

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = Path(args.dir or tempfile.gettempdir()) / "tunelab_bench_gguf"
    model = root / "model"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        build_model(model, args.size_mb)
    dist.barrier()

    size = [0]

    def tunelab_export() -> None:
        size[0] = export_gguf(model, quant="f16").stat().st_size

    def raw_write() -> None:
        share = size[0] // dist.get_world_size() + (size[0] % 2 if rank == 0 else 0)
        block = os.urandom(1 << 20)
        with open(root / f"raw-{rank}.bin", "wb") as handle:
            for start in range(0, share, len(block)):
                handle.write(block[: min(len(block), share - start)])
            handle.flush()
            os.fsync(handle.fileno())

    times: dict[str, list[float]] = {"tunelab": [], "raw": []}
    cpu: dict[str, list[float]] = {"tunelab": [], "raw": []}  # this process's CPU seconds

    def timed(name: str, action) -> None:
        start = time.process_time()
        times[name].append(time_collective(action))
        cpu[name].append(time.process_time() - start)

    tunelab_export()  # untimed warm-ups: imports, page cache, the output size for raw
    raw_write()
    for _ in range(args.repeats):
        timed("tunelab", tunelab_export)
        timed("raw", raw_write)
    t_tunelab, t_raw = (statistics.median(times[name]) for name in ("tunelab", "raw"))
    c_tunelab, c_raw = (statistics.median(cpu[name]) for name in ("tunelab", "raw"))
    if rank == 0:
        gib = size[0] / 2**30
        rows = [
            Row("vs raw write of the same bytes, fsync", seconds(t_tunelab), seconds(t_raw),
                f"{t_tunelab / t_raw:.2f}x", "<= 1.3x raw time", t_tunelab / t_raw <= 1.3),
            Row("vs llama.cpp convert_hf_to_gguf.py", seconds(t_tunelab), "not run",
                "-", ">= 2x faster", False),
        ]  # fmt: skip
        print_table(
            "GGUF export (f16) of a Llama-shaped model: tunelab vs raw disk",
            rows,
            notes=[
                f"{gib:.2f} GiB f16 GGUF from fp32 safetensors, {dist.get_world_size()} ranks, "
                f"fsync on, median of {args.repeats} after one untimed warm-up of each",
                f"rank 0's CPU time (median): export {c_tunelab:.3f} s, raw write "
                f"{c_raw:.3f} s; load average {os.getloadavg()[0]:.1f} at the end "
                "(the wall ratio is noisy under load; the CPU times less so)",
                "convert_hf_to_gguf.py is not in the gguf package nor any registry package "
                "installed here (it lives in llama.cpp's repository): not measured, so 'no'.",
            ],
        )
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    relaunch_under_torchrun(2)
    main()
