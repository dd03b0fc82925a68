"""Time the GGUF export of a Llama-shaped model: tunelab's 2-rank export vs a raw write of its
bytes and vs llama.cpp's ``convert_hf_to_gguf.py`` on the same folder.

Run (it relaunches itself under torchrun with 2 processes, gloo, CPU):

    python bench/bench_gguf.py --size-mb 512

A random fp32 Llama-shaped Hugging Face folder (the embedded tiny tokenizer, enough layers for
``--size-mb`` MB of f16 GGUF) is exported to f16 by ``export_gguf`` on both ranks, fsync on,
barrier to barrier, in two cases: into a folder without ``gguf/`` (as in a run, where the HF
export has just written the folder) and replacing the previous ``gguf/`` (its removal inside the
export). The raw write does to the disk what the export does: each rank writes its half of the
same number of bytes with ``O_DIRECT``, 4 MB at a time from one page-aligned buffer, into a new
preallocated file, and fsyncs it; in the second case the new file is renamed over the previous
one, whose removal is timed too. (The former baseline, a write through the page cache into the
truncated previous file, took 0.6 s to over 6 s for the same 1 GB on this VM, as fresh page-cache
memory came from its host or not; ``--buffered-raw`` times it as well.) llama.cpp's converter
(``_llama_converter``: fetched once from the llama-cpp-python sdist on PyPI into
``~/.cache/tunelab-bench/``) converts the same folder with ``--outtype f16`` in one process, its
output fsynced. Every side runs in every round, the order reversed every other round, after one
untimed warm-up; before each side, untimed, the state it starts from is set up (no file, or the
previous one) and everything synced. The table gives medians of ``--repeats`` rounds (ratios:
the median of each round's ratio), wall and CPU seconds (every process's), each rank's median
time per phase of the export (``gguf_export._LAST_TIMINGS``), and checks that both GGUF files
hold the same tensors (names, types, shapes and bytes) and that llama.cpp loads both.
``--smoke`` runs the converter only when it is already cached.
"""

import argparse
import json
import mmap
import os
import shutil
import tempfile
import time
from pathlib import Path

from _launch import relaunch_under_torchrun

if __name__ == "__main__":  # before the imports below: this process only relaunches
    relaunch_under_torchrun(2)

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
    seconds,
    time_collective,
)
from _llama_converter import convert, prepare
from tunelab._paths import assets_dir
from tunelab.checkpoint.gguf_export import _LAST_TIMINGS, export_gguf

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 1024, 2816, 16, 4, 810
_RAW_BLOCK = 4 << 20  # bytes per write of the raw side, as the export's buffers


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


def _phase_lines(label: str, rounds: list[dict[str, float]]) -> list[str]:
    """This rank's median seconds per export phase (``gguf_export._LAST_TIMINGS``), one line."""
    if not rounds:
        return []
    names = list(dict.fromkeys(name for one in rounds for name in one))
    parts = []
    for name in names:
        value = median(one.get(name, 0.0) for one in rounds)
        parts.append(
            f"{name} {value:.0f}" if name == "minor page faults" else f"{name} {value:.3f}"
        )
    return [f"{label}, medians: " + "; ".join(parts)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description="GGUF export time: tunelab vs a raw write and llama.cpp's converter"
    )
    parser.add_argument("--size-mb", type=int, default=512, help="f16 GGUF size, MB")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (each runs every side)")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--no-converter", action="store_true",
                        help="do not run (or fetch) llama.cpp's convert_hf_to_gguf.py")  # fmt: skip
    parser.add_argument("--buffered-raw", action="store_true",
                        help="also time a raw write through the page cache (the bench's former "
                        "baseline)")  # fmt: skip
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

    raw_file = root / f"raw-{rank}.bin"
    page = mmap.PAGESIZE
    block = mmap.mmap(-1, _RAW_BLOCK)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(_RAW_BLOCK))

    def raw_write(replace: bool, direct: bool = True) -> None:
        """This rank's half of the export's bytes into a new file, fsynced: with O_DIRECT from
        one aligned buffer into a preallocated file, as the export writes (buffered: through
        the page cache); ``replace``: renamed over the previous file, which goes with it."""
        share = size[0] // dist.get_world_size() + (size[0] % 2 if rank == 0 else 0)
        target = raw_file.with_suffix(".new") if replace else raw_file
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.posix_fallocate(fd, 0, share)
            out = os.open(target, os.O_WRONLY | os.O_DIRECT) if direct else os.dup(fd)
            try:
                whole = share - share % page  # O_DIRECT: whole pages; the tail as the export's
                for start in range(0, whole, _RAW_BLOCK):
                    os.pwrite(out, memoryview(block)[: min(_RAW_BLOCK, whole - start)], start)
            finally:
                os.close(out)
            os.pwrite(fd, memoryview(block)[: share - whole], whole)
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(target, raw_file)

    conversions: list = []

    def llama_cpp_convert() -> None:
        if rank == 0:
            conversions.append(convert(converter[0], model, converted, pre_tokenizer[0]))

    actions = {
        "tunelab, new folder": tunelab_export,
        "raw, new file": lambda: raw_write(replace=False),
        "tunelab, replacing gguf/": tunelab_export,
        "raw, replacing its file": lambda: raw_write(replace=True),
        "raw buffered, replacing its file": lambda: raw_write(replace=True, direct=False),
        "llama.cpp": llama_cpp_convert,
    }
    times: dict[str, list[float]] = {name: [] for name in actions}
    cpu: dict[str, list[float]] = {name: [] for name in actions}  # every rank's, summed
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in actions}  # this rank's

    def prepare_side(name: str) -> None:
        """Untimed: the state each side starts from (no file, or the previous one in place),
        then everything on disk (sync: the journal's commit, and with it the discards of what
        was deleted, before the clock starts)."""
        if name == "tunelab, new folder" and rank == 0:
            shutil.rmtree(model / "gguf", ignore_errors=True)  # as the HF export leaves it
        elif name == "tunelab, replacing gguf/" and not (model / "gguf").is_dir():
            tunelab_export()
        elif name == "raw, new file":
            raw_file.unlink(missing_ok=True)
        elif name.startswith("raw") and not raw_file.exists():
            raw_write(replace=False)
        dist.barrier()
        os.sync()
        dist.barrier()

    def timed(name: str, _round: int) -> dict:
        prepare_side(name)
        start = time.process_time()
        times[name].append(time_collective(actions[name]))
        cpu[name].append(sum(gather_floats(time.process_time() - start)))
        if name.startswith("tunelab"):
            phases[name].append(dict(_LAST_TIMINGS))
        return {}

    tunelab_export()  # untimed warm-ups: imports, page cache, the output size for raw
    raw_write(replace=True)
    sides = ["tunelab, new folder", "raw, new file", "tunelab, replacing gguf/",
             "raw, replacing its file"]  # fmt: skip
    sides += ["raw buffered, replacing its file"] if args.buffered_raw else []
    sides += ["llama.cpp"] if runs_converter else []
    alternating_rounds(timed, sides, args.repeats)
    split = [
        _phase_lines(f"rank {rank}'s phases, {name}", phases[name])
        for name in sides
        if name.startswith("tunelab")
    ]
    every_split: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_split, split)
    failed = next((c for c in conversions if isinstance(c, str)), None)
    if rank == 0:
        gib = size[0] / 2**30

        def versus(ours: str, theirs: str, figure: str, target: bool = True) -> Row:
            ratios = [a / b for a, b in zip(times[ours], times[theirs])]
            ratio = median(ratios)
            per_round = ", ".join(f"{r:.2f}" for r in ratios)
            return Row(figure, seconds(median(times[ours])), seconds(median(times[theirs])),
                       f"{ratio:.2f}x ({per_round})", "<= 1.3x raw time" if target else "-",
                       ratio <= 1.3 if target else None)  # fmt: skip

        rows = [
            versus("tunelab, new folder", "raw, new file",
                   "new gguf/ vs raw write of the same bytes to new files, O_DIRECT, fsync"),
            versus("tunelab, replacing gguf/", "raw, replacing its file",
                   "replacing gguf/ vs raw write renamed over its previous files"),
        ]  # fmt: skip
        if args.buffered_raw:
            rows.append(versus("tunelab, replacing gguf/", "raw buffered, replacing its file",
                               "replacing gguf/ vs raw buffered write renamed over its files",
                               target=False))  # fmt: skip
        t_tunelab = median(times["tunelab, new folder"])
        c_tunelab = median(cpu["tunelab, new folder"])
        notes = [
            f"{gib:.2f} GiB f16 GGUF from fp32 safetensors, {dist.get_world_size()} ranks, fsync "
            f"on; medians of {args.repeats} rounds (the sides' order reversed every other round; "
            "ratio: median of the rounds' ratios, each round's in brackets) after one untimed "
            "warm-up of tunelab's export and the raw write; before each side, untimed: the state "
            "it starts from (no gguf/, or the previous one; no raw file, or the previous one) "
            "and a sync",
            "raw write: each rank writes its half of the bytes (4 MB writes from one page-aligned "
            "buffer, O_DIRECT, into a new preallocated file: what the export does to the disk), "
            "fsync; 'replacing': renamed over the previous round's file, whose removal is timed "
            "as the export's removal of the previous gguf/ is",
            "CPU seconds, both ranks summed (median): "
            + ", ".join(
                f"{name} {median(cpu[name]):.3f} s" for name in sides if name != "llama.cpp"
            ),
        ]
        for lines in zip(*every_split):
            notes += [line for rank_lines in lines for line in rank_lines]
        if not runs_converter or failed:
            reason = failed or converter[0]
            rows.append(Row("vs llama.cpp convert_hf_to_gguf.py", seconds(t_tunelab),
                            f"not run: {reason}", "-", ">= 2x faster", False))  # fmt: skip
        else:
            whole = median(c.seconds for c in conversions)
            proper = median(c.convert_seconds for c in conversions)
            mine = times["tunelab, new folder"]
            ratio = median(c.convert_seconds / t for c, t in zip(conversions, mine))
            ratio_whole = median(c.seconds / t for c, t in zip(conversions, mine))
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
    main()
