"""HF safetensors I/O: layout, round trips, and one clear error per bad input."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tunelab.checkpoint import HFCheckpointReader, copy_model_files, parse_size
from tunelab.checkpoint.hf_sharded import save_hf_sharded
from tunelab.errors import CheckpointError
from tunelab.formats.integrity import MANIFEST_NAME
from tunelab.models import ModelArgs, TransformerDecoder, load_hf_into_model, load_pretrained


def tiny_model(tie: bool = False) -> TransformerDecoder:
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=50, dim=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_dim=32,
        tie_embeddings=tie,
    )  # fmt: skip
    return TransformerDecoder(args)


def write_hf_checkpoint(state, path, *, config=None, **kwargs):
    """A checkpoint folder as the hub has one: tunelab's exporter, a config.json, no manifest."""
    out = save_hf_sharded(state, path, **kwargs)
    (out / MANIFEST_NAME).unlink()
    if config is not None:
        (out / "config.json").write_text(json.dumps(config))
    return out


def save(model: TransformerDecoder, path, **kwargs):
    adapter = model.state_dict_adapter
    state = adapter.to_hf(model.state_dict())
    return write_hf_checkpoint(state, path, config=adapter.hf_config(torch.float32), **kwargs)


@pytest.fixture
def checkpoint(tmp_path):
    model = tiny_model()
    path = save(model, tmp_path / "ckpt")
    (path / "tokenizer.json").write_text("{}")
    return model, path


@pytest.fixture
def sharded(tmp_path):
    model = tiny_model(tie=True)
    return model, save(model, tmp_path / "sharded", max_shard_size=3000)


def listing(path):
    return sorted(p.name for p in path.iterdir())


# ---- layout and reading -------------------------------------------------------------------
def test_single_file_layout_and_reader(checkpoint):
    model, path = checkpoint
    assert listing(path) == ["config.json", "model.safetensors", "tokenizer.json"]
    reader = HFCheckpointReader(path)
    weight = model.model.layers[1].mlp.up_proj.weight
    key = "model.layers.1.mlp.up_proj.weight"
    assert len(reader) == 2 * 9 + 3 and key in reader
    assert reader.shape(key) == (32, 16) and reader.dtype(key) == torch.float32
    assert reader.file_of(key) == path / "model.safetensors"
    torch.testing.assert_close(reader.get(key), weight, rtol=0, atol=0)
    torch.testing.assert_close(reader.get_rows(key, 5, 9), weight[5:9], rtol=0, atol=0)
    assert reader.get_rows(key, 32, 32).shape == (0, 16)
    assert reader.get(key, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(CheckpointError, match=r"rows 30:33 out of range for 'model.layers.1.mlp"):
        reader.get_rows(key, 30, 33)
    with pytest.raises(CheckpointError, match="no tensor named 'nope'"):
        reader.get("nope")


def test_sharded_layout_index_and_metadata(sharded):
    model, path = sharded
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert (
        len(files) >= 3 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    )
    index = json.loads((path / "model.safetensors.index.json").read_text())
    state = model.state_dict_adapter.to_hf(model.state_dict())
    assert "lm_head.weight" not in index["weight_map"]  # tied
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == 4 * sum(t.numel() for t in state.values())
    for name in files:
        assert (path / name).stat().st_size < 3000 + 1000  # data under the limit, plus header
        with safe_open(path / name, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    reader = HFCheckpointReader(path)
    assert reader.fqn_to_file == index["weight_map"]
    for key, tensor in state.items():
        torch.testing.assert_close(reader.get(key), tensor, rtol=0, atol=0)


def test_save_with_fqn_to_file_reproduces_layout(sharded, tmp_path):
    model, path = sharded
    layout = HFCheckpointReader(path).fqn_to_file
    out = save(model, tmp_path / "again", fqn_to_file=layout)
    assert HFCheckpointReader(out).fqn_to_file == layout
    with pytest.raises(CheckpointError, match="fqn_to_file has no file for 'model.norm.weight'"):
        save(
            model,
            tmp_path / "bad",
            fqn_to_file={k: v for k, v in layout.items() if k != "model.norm.weight"},
        )


def test_bf16_export_records_dtype_and_loads_in_config_dtype(checkpoint, tmp_path):
    model, path = checkpoint
    state = model.state_dict_adapter.to_hf(model.state_dict())
    state = {key: value.to(torch.bfloat16) for key, value in state.items()}
    out = write_hf_checkpoint(state, tmp_path / "bf16", source_dir=path, torch_dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").read_text() == "{}"
    assert HFCheckpointReader(out).dtype("model.norm.weight") == torch.bfloat16
    loaded = load_pretrained(out, dtype=None)
    assert loaded.model.norm.weight.dtype == torch.bfloat16
    assert not loaded.training


def test_load_pretrained_round_trip_tied(sharded):
    model, path = sharded
    loaded = load_pretrained(path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tokens = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)


def test_tied_checkpoint_with_identical_lm_head_is_accepted(tmp_path):
    model = tiny_model(tie=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}  # lm_head.weight included
    write_hf_checkpoint(state, tmp_path / "ckpt", config=model.state_dict_adapter.hf_config())
    assert "lm_head.weight" in HFCheckpointReader(tmp_path / "ckpt")
    load_pretrained(tmp_path / "ckpt")
    state["lm_head.weight"] += 1
    write_hf_checkpoint(state, tmp_path / "ckpt", config=model.state_dict_adapter.hf_config())
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from 'model.embed_tokens"):
        load_pretrained(tmp_path / "ckpt")


def test_lora_params_are_reported_missing_not_an_error(checkpoint):
    _, path = checkpoint
    model = tiny_model()
    model.layers[0].self_attn.q_proj.lora_A = nn.Linear(16, 2, bias=False)
    result = load_hf_into_model(model, path)
    assert result.missing == ["model.layers.0.self_attn.q_proj.lora_A.weight"]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500 MB") == 500 * 10**6
    assert parse_size(1234) == 1234
    with pytest.raises(CheckpointError, match="'5 parsecs' is not a size"):
        parse_size("5 parsecs")


def test_copy_model_files_never_copies_weights_or_adapters(checkpoint, tmp_path):
    _, path = checkpoint
    (path / "adapter_config.json").write_text("{}")
    (path / "generation_config.json").write_text("{}")
    out = tmp_path / "copy"
    out.mkdir()
    copied = copy_model_files(path, out, torch.float16)
    assert sorted(copied) == ["config.json", "generation_config.json", "tokenizer.json"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"


# ---- bad input: one clear error, nothing half-written -------------------------------------
def test_missing_directory_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*nowhere does not exist"):
        HFCheckpointReader(tmp_path / "nowhere")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(
        CheckpointError, match=r"neither model.safetensors .*found pytorch_model.bin"
    ):
        HFCheckpointReader(tmp_path)


def test_index_names_a_missing_file(sharded):
    _, path = sharded
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(
        CheckpointError, match=f"{victim.name} is missing; model.safetensors.index.json"
    ):
        load_pretrained(path)


def test_truncated_file(checkpoint):
    _, path = checkpoint
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(
        CheckpointError, match=r"model.safetensors: truncated safetensors file: '.*' ends at byte"
    ):
        load_pretrained(path)
    file.write_bytes(file.read_bytes()[:5])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated safetensors file"):
        HFCheckpointReader(path)


def test_corrupt_header(checkpoint):
    _, path = checkpoint
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:12] = b"#!@x"
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header"):
        load_pretrained(path)
    file.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header"):
        HFCheckpointReader(path)


def _rewrite(path, edit):
    state = dict(HFCheckpointReader(path).fqn_to_file)
    tensors = {key: HFCheckpointReader(path).get(key) for key in state}
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_key(checkpoint):
    _, path = checkpoint
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError, match="missing key 'model.layers.1.mlp.down_proj.weight'"):
        load_pretrained(path)


def test_unexpected_key(checkpoint):
    _, path = checkpoint
    _rewrite(path, lambda t: t.update({"model.layers.7.extra.weight": torch.zeros(2)}))
    with pytest.raises(
        CheckpointError, match="model.safetensors: unexpected key 'model.layers.7.extra.weight'"
    ):
        load_pretrained(path)
    load_hf_into_model(tiny_model(), path, strict=False)  # non-strict ignores it


def test_shape_mismatch_with_config(checkpoint):
    _, path = checkpoint
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 48
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: 'model.layers.0.mlp.gate_proj.weight' has shape \(32, 16\) but the config gives \(48, 16\)",
    ):
        load_pretrained(path)


def test_failed_save_keeps_existing_output_and_leaves_no_temp(checkpoint, tmp_path):
    model, path = checkpoint
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    state = {k: v + 1 for k, v in model.state_dict_adapter.to_hf(model.state_dict()).items()}
    with pytest.raises(CheckpointError, match="source directory .*missing does not exist"):
        save_hf_sharded(state, path, source_dir=tmp_path / "missing")
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert listing(path.parent) == ["ckpt"]
    # A successful save replaces the folder whole: the new one holds exactly what it wrote.
    # The old one held files tunelab did not write (it made no manifest): kept aside, whole.
    save_hf_sharded(state, path, max_shard_size=3000)
    assert "model.safetensors" not in listing(path) and "tokenizer.json" not in listing(path)
    kept = [name for name in listing(path.parent) if name != "ckpt"]
    assert len(kept) == 1 and kept[0].startswith("ckpt.replaced-")
    assert {p.name: p.read_bytes() for p in (path.parent / kept[0]).iterdir()} == before
    torch.testing.assert_close(
        HFCheckpointReader(path).get("model.norm.weight"), state["model.norm.weight"]
    )


def test_save_rejects_values_that_are_not_tensors(tmp_path):
    with pytest.raises(CheckpointError, match="'w' is not a tensor"):
        save_hf_sharded({"w": [1.0, 2.0]}, tmp_path / "out")
    assert listing(tmp_path) == []
