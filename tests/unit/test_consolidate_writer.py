"""HFSafetensorsWriter through a real dcp.save in one process (no group, and a world-1 group)."""

import json
import struct

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.tensor import Shard, distribute_tensor

from tunelab.checkpoint.consolidate import HFSafetensorsWriter
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.errors import CheckpointError, ConfigError
from tunelab.formats import integrity, layout
from tunelab.formats.layout import temporary_name

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _mixed_state():
    generator = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(7, 4, generator=generator),
        "model.layers.0.mlp.up_proj.weight": torch.randn(5, 4, generator=generator).bfloat16(),
        "model.layers.0.counts": torch.arange(6, dtype=torch.int64).reshape(2, 3) - 3,
        "model.layers.0.mask": torch.tensor([True, False, True]),
        "model.layers.0.small": torch.tensor([1, 2, 3], dtype=torch.int8),
        "model.norm.weight": torch.randn(4, generator=generator).half(),
        "model.scale": torch.tensor(2.5),
        "model.empty": torch.zeros(0, 3),
    }


def _read_header(path):
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return 8 + length, json.loads(raw[8 : 8 + length]), len(raw)


def _check_folder(folder, state, expected_files):
    files = sorted(p.name for p in folder.iterdir())
    assert files == sorted(expected_files)
    loaded = {}
    for name in expected_files:
        if not name.endswith(".safetensors"):
            continue
        tensors = load_file(folder / name)
        with safe_open(folder / name, framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            assert set(handle.keys()) == set(tensors)
            for key in handle.keys():
                assert torch.equal(handle.get_tensor(key), tensors[key])
        data_start, header, file_size = _read_header(folder / name)
        assert data_start % 8 == 0
        spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
        assert spans[0][0] == 0 and spans[-1][1] == file_size - data_start
        for (_, end), (begin, _) in zip(spans, spans[1:]):
            assert end == begin  # no gaps
        for key, value in header.items():
            if key != "__metadata__":
                itemsize = tensors[key].element_size()
                assert (data_start + value["data_offsets"][0]) % itemsize == 0
        assert not loaded.keys() & tensors.keys()
        loaded |= tensors
    assert loaded.keys() == state.keys()
    for key, tensor in state.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    return loaded


def test_greedy_split_mixed_dtypes(tmp_path):
    state = _mixed_state()
    # 7*4*4 = 112 bytes fills the first file; the rest (40+48+3+3+8+4+0 = 106) the second.
    writer = HFSafetensorsWriter(tmp_path, max_shard_size=120)
    dcp.save(state, storage_writer=writer)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    _check_folder(tmp_path, state, [first, second, "model.safetensors.index.json"])
    # Checksums of header and every tensor piece, taken as they were written, tile each file.
    assert sorted(writer.file_records) == [first, second, "model.safetensors.index.json"]
    assert integrity.problems_in(tmp_path, writer.file_records) == []
    assert len(writer.file_records[first]["ranges"]) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 112 + 106}
    assert index["weight_map"] == {
        key: first if key == "model.embed_tokens.weight" else second for key in state
    }
    assert set(load_file(tmp_path / first)) == {"model.embed_tokens.weight"}


def test_fqn_to_file_names_are_kept(tmp_path):
    state = _mixed_state()
    mapping = {key: f"model-0000{1 + i % 3}-of-00003.safetensors" for i, key in enumerate(state)}
    dcp.save(state, storage_writer=HFSafetensorsWriter(tmp_path, fqn_to_file=mapping))
    files = sorted(set(mapping.values())) + ["model.safetensors.index.json"]
    _check_folder(tmp_path, state, files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == mapping
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in state.values()
    )
    for key, file_name in mapping.items():
        assert key in load_file(tmp_path / file_name)


def test_single_file_has_no_index_and_overwrites_stale_files(tmp_path):
    state = _mixed_state()
    # Leftovers of an older export and of a crashed attempt (bigger, full of junk).
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    (tmp_path / temporary_name("model.safetensors", "partial")).write_bytes(b"\xff" * 100_000)
    dcp.save(state, storage_writer=HFSafetensorsWriter(tmp_path, sync_files=False))
    _check_folder(tmp_path, state, ["model.safetensors"])


def test_output_reads_back_through_dcp_reader(tmp_path):
    state = _mixed_state()
    del state["model.empty"]  # torch's reader cannot narrow a zero-size tensor
    dcp.save(
        state, storage_writer=HFSafetensorsWriter(tmp_path, max_shard_size=100, thread_count=3)
    )
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    dcp.load(target, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path)))
    for key, value in state.items():
        assert torch.equal(target[key], value), key


def test_non_tensor_value_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="'step' is not a tensor"):
        save_hf_sharded({"w": torch.ones(2), "step": 3}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_key_in_mapping_is_a_clear_error(tmp_path):
    state = {"a": torch.ones(2), "b": torch.ones(2)}
    with pytest.raises(CheckpointError, match="first \\['b'\\]"):
        save_hf_sharded(state, tmp_path / "out", fqn_to_file={"a": "model.safetensors"})


def test_world_one_dtensors_replace_an_existing_export(world_of_one, tmp_path):
    state = _mixed_state()
    del state["model.scale"]  # Shard(0) needs a dimension
    sharded = {
        key: distribute_tensor(value, world_of_one, [Shard(0)]) for key, value in state.items()
    }
    source = tmp_path / "base"
    source.mkdir()
    (source / "config.json").write_text(
        json.dumps({"model_type": "llama", "torch_dtype": "float32"})
    )
    (source / "tokenizer.json").write_text("{}")
    out = tmp_path / "epoch_0"
    out.mkdir()
    # A previous export of tunelab's: its manifest lists what it wrote.
    stale = integrity.write_bytes(out / "model-00001-of-00009.safetensors", b"stale weights")
    layout.write_manifest(out, {"model-00001-of-00009.safetensors": stale}, kind="export")

    def write_adapter(new_export):  # first, into the new folder, as a LoRA export does
        (new_export / "adapter").mkdir()
        record = integrity.write_bytes(new_export / "adapter" / "adapter_config.json", b"{}")
        layout.write_manifest(new_export / "adapter", {"adapter_config.json": record})

    result = save_hf_sharded(
        sharded,
        out,
        max_shard_size="100B",
        process_group=dist.group.WORLD,
        source_dir=source,
        torch_dtype=torch.bfloat16,
        first=write_adapter,
    )
    assert result == out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weights = sorted(set(index["weight_map"].values()))
    extra = ["adapter", "config.json", "tokenizer.json", "model.safetensors.index.json"]
    _check_folder(out, state, weights + extra + ["tunelab_manifest.json"])
    # The manifest lists every file written, with checksums taken as the bytes were written.
    manifest = json.loads((out / "tunelab_manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(weights + extra[1:])
    assert integrity.problems_in(out, manifest["files"]) == []
    assert (out / "adapter" / "adapter_config.json").read_text() == "{}"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "epoch_0"]
    # Replaced whole: a second export without an adapter leaves none behind.
    save_hf_sharded(sharded, out, process_group=dist.group.WORLD, source_dir=source)
    assert not (out / "adapter").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "epoch_0"]


def test_a_replaced_export_with_files_tunelab_did_not_write_is_kept_aside(tmp_path):
    state = _mixed_state()
    out = tmp_path / "epoch_0"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    save_hf_sharded(state, out, sync_files=False)
    assert not (out / "notes.txt").exists() and (out / "tunelab_manifest.json").is_file()
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("epoch_0.replaced-")]
    assert len(kept) == 1 and (kept[0] / "notes.txt").read_text() == "the user's"


def test_max_shard_size_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match="max_shard_size"):
        HFSafetensorsWriter(tmp_path, max_shard_size=0)
