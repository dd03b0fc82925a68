"""Time the GGUF export of a Llama-shaped model: tunelab's 2-rank export vs a raw write of its
bytes and vs llama.cpp's ``convert_hf_to_gguf.py`` on the same folder.

Run (it relaunches itself under torchrun with 2 processes, gloo, CPU):

    python bench/bench_gguf.py --size-mb 512

A random fp32 Llama-shaped Hugging Face folder (the embedded tiny tokenizer, enough layers for
``--size-mb`` MB of f16 GGUF) is exported to f16 by ``export_gguf`` on both ranks, fsync on,
barrier to barrier; the baseline writes the same number of bytes, each rank half into its own
file, with fsync; llama.cpp's converter (``_llama_converter``: fetched once from the
llama-cpp-python sdist on PyPI into ``~/.cache/tunelab-bench/``) converts the same folder with
``--outtype f16`` in one process, its output fsynced. The three run in every round, the order
reversed every other round, after one untimed warm-up of tunelab's export and the raw write;
the table gives medians of ``--repeats`` rounds, wall and CPU seconds (every process's), and
checks that both GGUF files hold the same tensors (names, types, shapes and bytes) and that
llama.cpp loads both. ``--smoke`` runs the converter only when it is already cached.
"""

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from _common import (
    Row,
    alternating_rounds,
    gather_floats,
    median,
    parse_bench_args,
    print_table,
    relaunch_under_torchrun,
    seconds,
    time_collective,
)
from _llama_converter import convert, prepare
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


def _same_tensors(ours: Path, theirs: Path) -> str:
    """Whether two GGUF files hold the same tensors: names, types, shapes and bytes."""
    import gguf
    import numpy as np

    tables = []
    for path in (ours, theirs):
        reader = gguf.GGUFReader(path)
        tables.append({t.name: (t.tensor_type, tuple(t.shape), t.data) for t in reader.tensors})
    if tables[0].keys() != tables[1].keys():
        differ = sorted(tables[0].keys() ^ tables[1].keys())
        return f"no: {len(differ)} tensor names differ ({differ[0]}, ...)"
    for name, (qtype, shape, data) in tables[0].items():
        other = tables[1][name]
        if (qtype, shape) != other[:2] or not np.array_equal(data, other[2]):
            return f"no: {name} differs"
    return f"yes, {len(tables[0])} tensors, bytes equal"


def _llama_cpp_loads(paths: list[Path]) -> str:
    try:
        import llama_cpp
    except ImportError:
        return "not checked (llama_cpp not installed)"
    for path in paths:
        try:
            llama_cpp.Llama(model_path=str(path), n_ctx=16, n_threads=1, verbose=False)
        except Exception as error:  # noqa: BLE001 - reported in the table's notes
            return f"no: {path.name}: {type(error).__name__}: {error}"
    return "yes, both"


def main() -> None:
    parser = argparse.ArgumentParser(
        description="GGUF export time: tunelab vs a raw write and llama.cpp's converter"
    )
    parser.add_argument("--size-mb", type=int, default=512, help="f16 GGUF size, MB")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each runs all three)")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--no-converter", action="store_true",
                        help="do not run (or fetch) llama.cpp's convert_hf_to_gguf.py")  # fmt: skip
    args = parse_bench_args(parser, smoke=["--size-mb", "8", "--repeats", "1"])

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = Path(args.dir or tempfile.gettempdir()) / "tunelab_bench_gguf"
    model = root / "model"
    converted = root / "llama-cpp-f16.gguf"
    converter: list = [None]
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        build_model(model, args.size_mb)
        converter = [
            "--no-converter given" if args.no_converter else prepare(download=not args.smoke)
        ]
    dist.broadcast_object_list(converter)
    runs_converter = not isinstance(converter[0], str)
    dist.barrier()

    size, pre_tokenizer = [0], [""]

    def tunelab_export() -> None:
        path = export_gguf(model, quant="f16")
        size[0] = path.stat().st_size
        if rank == 0 and not pre_tokenizer[0]:
            import gguf

            field = gguf.GGUFReader(path).get_field("tokenizer.ggml.pre")
            pre_tokenizer[0] = field.contents()

    def raw_write() -> None:
        share = size[0] // dist.get_world_size() + (size[0] % 2 if rank == 0 else 0)
        block = os.urandom(1 << 20)
        with open(root / f"raw-{rank}.bin", "wb") as handle:
            for start in range(0, share, len(block)):
                handle.write(block[: min(len(block), share - start)])
            handle.flush()
            os.fsync(handle.fileno())

    conversions: list = []

    def llama_cpp_convert() -> None:
        if rank == 0:
            conversions.append(convert(converter[0], model, converted, pre_tokenizer[0]))

    actions = {"tunelab": tunelab_export, "raw": raw_write, "llama.cpp": llama_cpp_convert}
    times: dict[str, list[float]] = {name: [] for name in actions}
    cpu: dict[str, list[float]] = {name: [] for name in actions}  # every rank's, summed

    def timed(name: str, _round: int) -> dict:
        start = time.process_time()
        times[name].append(time_collective(actions[name]))
        cpu[name].append(sum(gather_floats(time.process_time() - start)))
        return {}

    tunelab_export()  # untimed warm-ups: imports, page cache, the output size for raw
    raw_write()
    sides = ["tunelab", "raw"] + (["llama.cpp"] if runs_converter else [])
    alternating_rounds(timed, sides, args.repeats)
    failed = next((c for c in conversions if isinstance(c, str)), None)
    if rank == 0:
        gib = size[0] / 2**30
        t_tunelab, t_raw = median(times["tunelab"]), median(times["raw"])
        c_tunelab, c_raw = median(cpu["tunelab"]), median(cpu["raw"])
        rows = [
            Row("vs raw write of the same bytes, fsync", seconds(t_tunelab), seconds(t_raw),
                f"{t_tunelab / t_raw:.2f}x", "<= 1.3x raw time", t_tunelab / t_raw <= 1.3),
        ]  # fmt: skip
        notes = [
            f"{gib:.2f} GiB f16 GGUF from fp32 safetensors, {dist.get_world_size()} ranks, "
            f"fsync on, median of {args.repeats} rounds (order reversed every other round) "
            "after one untimed warm-up of tunelab's export and the raw write",
            f"CPU seconds, both ranks summed (median): export {c_tunelab:.3f} s, raw write "
            f"{c_raw:.3f} s; CPU ratio {c_tunelab / max(c_raw, 1e-9):.2f}x",
        ]
        if not runs_converter or failed:
            reason = failed or converter[0]
            rows.append(Row("vs llama.cpp convert_hf_to_gguf.py", seconds(t_tunelab),
                            f"not run: {reason}", "-", ">= 2x faster", False))  # fmt: skip
        else:
            whole = median(c.seconds for c in conversions)
            proper = median(c.convert_seconds for c in conversions)
            ratio = median(c.convert_seconds / t for c, t in zip(conversions, times["tunelab"]))
            ratio_whole = median(c.seconds / t for c, t in zip(conversions, times["tunelab"]))
            cpu_whole = median(c.cpu for c in conversions)
            cpu_proper = median(c.convert_cpu for c in conversions)
            rows += [
                Row("vs llama.cpp convert_hf_to_gguf.py, conversion (after its imports)",
                    seconds(t_tunelab), seconds(proper), f"{ratio:.2f}x faster", ">= 2x faster",
                    ratio >= 2.0),
                Row("vs llama.cpp convert_hf_to_gguf.py, whole process", seconds(t_tunelab),
                    seconds(whole), f"{ratio_whole:.2f}x faster", "-", None),
                Row("CPU seconds vs convert_hf_to_gguf.py, conversion (whole process)",
                    f"{c_tunelab:.3f} s", f"{cpu_proper:.3f} s ({cpu_whole:.3f} s)",
                    f"{cpu_proper / c_tunelab:.2f}x ({cpu_whole / c_tunelab:.2f}x) less",
                    "-", None),
            ]  # fmt: skip
            notes += [
                f"convert_hf_to_gguf.py from llama-cpp-python {converter[0].version}'s sdist, "
                "--outtype f16, one process, its output fsynced; ratio = median over rounds of "
                "its time / tunelab's in the same round (met judged on the conversion after "
                "its imports, the stricter figure); its pre-tokenizer hash check answered with "
                f"tunelab's name ({pre_tokenizer[0]!r}), the random tokenizer being unknown to it",
                "same tensors in both files: "
                + _same_tensors(model / "gguf" / "model-f16.gguf", converted),
                "llama.cpp loads: "
                + _llama_cpp_loads([model / "gguf" / "model-f16.gguf", converted]),
            ]
        notes.append(
            f"load average {os.getloadavg()[0]:.1f} at the end (the wall ratios are noisy "
            "under load; the CPU times less so)"
        )
        print_table("GGUF export (f16) of a Llama-shaped model: tunelab vs raw disk and "
                    "llama.cpp's converter", rows, notes=notes)  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    relaunch_under_torchrun(2)
    main()
