"""Checksums taken while writing, verification, and step checkpoints that never unpickle."""

import json
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tunelab.checkpoint import _dcp_json
from tunelab.checkpoint.dcp import ChecksummedWriter, load, saved_keys
from tunelab.errors import CheckpointError
from tunelab.formats import integrity, layout


class _Payload:
    """Unpickling this creates ``marker``: the attack a checkpoint must never carry out."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _state():
    generator = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(5, 3, generator=generator), "b": torch.arange(4.0)},
        "optimizer": {"step": torch.tensor(3.0), "m": torch.randn(7, generator=generator)},
    }


def _assert_loads_the_state(path):
    target = {
        "model": {"w": torch.zeros(5, 3), "b": torch.zeros(4)},
        "optimizer": {"step": torch.tensor(0.0), "m": torch.zeros(7)},
    }
    load(target, path)
    expected = _state()
    for group in expected:
        for key in expected[group]:
            assert torch.equal(target[group][key], expected[group][key]), key


def _save(path):
    writer = ChecksummedWriter(path)
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    return writer.file_records


def test_hashing_writer_records_what_reaches_the_file(tmp_path):
    path = tmp_path / "f.bin"
    with open(path, "wb") as file:
        stream = integrity.HashingWriter(file)
        for block in (b"abc", bytearray(b"defg"), memoryview(b"h" * 1000)):
            stream.write(block)
        assert stream.tell() == 1007
    record = stream.record()
    assert record == integrity.record_of(path.read_bytes())
    assert integrity.check_file(path, record) is None


def test_hashing_in_a_second_thread_gives_the_same_record(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    blocks = [b"a" * 10, bytes(range(256)) * 8192, b"z", bytes(3 << 20)]  # small and large
    path = tmp_path / "f.bin"
    with open(path, "wb") as file, ThreadPoolExecutor(1) as hasher:
        stream = integrity.HashingWriter(file, hasher)
        for block in blocks:
            stream.write(block)
    assert (
        stream.record()
        == integrity.record_of(b"".join(blocks))
        == integrity.record_of(path.read_bytes())
    )


def test_ranges_must_tile_the_file():
    pieces = [(4, 4, "b"), (0, 4, "a")]
    assert integrity.record_of_ranges(pieces, 8)["ranges"] == [[0, 4, "a"], [4, 4, "b"]]
    with pytest.raises(CheckpointError, match="gap or overlap at byte 4"):
        integrity.record_of_ranges([(0, 4, "a"), (5, 3, "b")], 8)
    with pytest.raises(CheckpointError, match="cover 8 bytes of a 9-byte file"):
        integrity.record_of_ranges(pieces, 9)


def test_multi_range_record_finds_the_range_that_changed(tmp_path):
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 4
    path.write_bytes(data)
    record = integrity.record_of_ranges(
        [(0, 100, integrity.digest(data[:100])), (100, 924, integrity.digest(data[100:]))], 1024
    )
    assert integrity.check_file(path, record) is None
    path.write_bytes(data[:500] + b"\xff" + data[501:])
    assert integrity.check_file(path, record) == (
        "content differs from its checksum (bytes 100..1024)"
    )
    assert integrity.check_file(path, {"size": "x"}) == "its manifest record is malformed"


def test_verify_folder_checks_sub_manifests_and_names_unlisted_files(tmp_path):
    export, adapter = tmp_path / "epoch_0", tmp_path / "epoch_0" / "adapter"
    adapter.mkdir(parents=True)
    layout.write_manifest(export, {"a.json": integrity.write_bytes(export / "a.json", b"{}")})
    layout.write_manifest(adapter, {"w": integrity.write_bytes(adapter / "w", b"123")})
    assert integrity.verify_folder(export) == []
    (export / "extra.bin").write_bytes(b"?")
    (adapter / "w").write_bytes(b"124")
    problems = integrity.verify_folder(export)
    assert problems == [
        f"{export / 'extra.bin'}: not listed in the manifest",
        f"{adapter / 'w'}: content differs from its checksum (bytes 0..3)",
    ]
    assert "is missing" in integrity.verify_folder(tmp_path / "nothing")[0]


def test_manifest_cannot_point_outside_its_folder(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s")
    inner = tmp_path / "step_1"
    inner.mkdir()
    files = {"../secret": integrity.record_of(b"s")}
    assert "outside the folder" in integrity.problems_in(inner, files)[0]


def test_step_checkpoint_is_json_and_tensors_only_and_round_trips(tmp_path):
    records = _save(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert ".metadata" not in names  # DCP's pickled metadata is never written
    assert sorted(records) == names == [".metadata.json", "__0_0.distcp"]
    for name, record in records.items():
        assert integrity.check_file(tmp_path / name, record) is None, name
    _assert_loads_the_state(tmp_path)
    assert saved_keys(tmp_path) == {"model.w", "model.b", "optimizer.step", "optimizer.m"}


def test_pickled_metadata_is_never_read(tmp_path):
    _save(tmp_path)
    marker = tmp_path / "pwned"
    # A planted `.metadata` pickle is ignored: the loader reads only .metadata.json.
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    load({"model": {"b": torch.zeros(4)}}, tmp_path)
    # A pickle in place of .metadata.json is a clear error, not code execution.
    (tmp_path / ".metadata.json").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata\.json: unreadable checkpoint metadata"):
        load({"model": {"b": torch.zeros(4)}}, tmp_path)
    assert not marker.exists()


def test_crafted_tensor_record_is_refused_without_running_it(tmp_path):
    _save(tmp_path)
    marker = tmp_path / "pwned"
    metadata = json.loads((tmp_path / ".metadata.json").read_text())
    # An attacker rewrites the data file with a pickle that runs code and points every item
    # at it (even with the checksums recomputed, the loader never executes it): raw records
    # are bytes of the size the metadata gives, never deserialized.
    payload = pickle.dumps(_Payload(marker))
    (tmp_path / "__0_0.distcp").write_bytes(payload)
    for item in metadata["items"]:
        item[4:6] = [0, len(payload)]
    (tmp_path / ".metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(CheckpointError, match="'model.b' is .* bytes, which is not the size"):
        load({"model": {"b": torch.zeros(4)}}, tmp_path)
    # The format tunelab wrote before raw files (torch.save records) is still read, and a
    # pickle there is refused by torch.load(weights_only=True), never run.
    metadata["format"] = "tunelab-dcp-metadata/1"
    (tmp_path / ".metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(CheckpointError, match="cannot load .*Weights only load failed"):
        load({"model": {"b": torch.zeros(4)}}, tmp_path)
    assert not marker.exists()


class _TorchSaveWriter(dcp.FileSystemWriter):
    """torch's writer (a torch.save record per tensor) with the JSON metadata of format 1."""

    def finish(self, metadata, results):
        storage_data = {r.index: r.storage_data for rank in results for r in rank}
        payload = json.dumps(_dcp_json.to_json(metadata, storage_data, raw_records=False))
        (self.path / ".metadata.json").write_text(payload)


def test_checkpoints_of_the_torch_save_format_still_load(tmp_path):
    # A run saved by tunelab before raw tensor files resumes after an upgrade.
    dcp.save(_state(), storage_writer=_TorchSaveWriter(tmp_path), no_dist=True)
    _assert_loads_the_state(tmp_path)


def test_raw_records_are_the_tensor_bytes_at_aligned_offsets_one_range_each(tmp_path):
    from tunelab.checkpoint._tensor_files import ALIGN

    records = _save(tmp_path)
    metadata = json.loads((tmp_path / ".metadata.json").read_text())
    assert metadata["format"] == "tunelab-dcp-metadata/2"
    data = (tmp_path / "__0_0.distcp").read_bytes()
    state = _state()
    ranges = records["__0_0.distcp"]["ranges"]
    assert len(ranges) == len(metadata["items"]) == 4
    ends = {offset + length for offset, length, _ in ranges}
    for fqn, _, _, name, offset, length in metadata["items"]:
        group, key = fqn.split(".")
        expected = state[group][key].reshape(-1).view(torch.uint8).numpy().tobytes()
        assert name == "__0_0.distcp" and offset % ALIGN == 0
        assert data[offset : offset + length] == expected, fqn
        assert offset + length in ends, fqn  # an item's range ends where the item does


def test_a_load_verifies_what_it_reads_and_names_the_range(tmp_path):
    from tunelab.checkpoint._tensor_files import ContentMismatch

    records = _save(tmp_path)
    metadata = json.loads((tmp_path / ".metadata.json").read_text())
    offset = next(item[4] for item in metadata["items"] if item[0] == "optimizer.m")
    target = {"optimizer": {"m": torch.zeros(7)}}
    verified = load(target, tmp_path, records)
    (start,) = [r[0] for r in records["__0_0.distcp"]["ranges"] if r[0] <= offset < r[0] + r[1]]
    assert verified == {("__0_0.distcp", start)}  # only the range it read
    with open(tmp_path / "__0_0.distcp", "r+b") as file:
        file.seek(offset + 5)
        byte = file.read(1)
        file.seek(offset + 5)
        file.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ContentMismatch, match=r"__0_0\.distcp: content differs from its checksum"):
        load(target, tmp_path, records)
    # Without records nothing is verified (a caller's choice); the flipped bit arrives.
    load(target, tmp_path)
    assert not torch.equal(target["optimizer"]["m"], _state()["optimizer"]["m"])
    # Another item, not read by this load, is untouched by the flip and still verifies.
    assert load({"model": {"w": torch.zeros(5, 3)}}, tmp_path, records)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["tensors"]["model.b"].update(dtype="torch.complex64"), "unsupported dtype"),
        (lambda m: m.update(format="pickle"), "format"),
        (lambda m: m["items"][0].__setitem__(3, "../elsewhere.distcp"), "not a file of"),
        (lambda m: m["items"][0].__setitem__(4, -1), "non-negative integer"),
        (lambda m: m["tensors"].__setitem__("extra", {"bytes": True}), "dtype"),
    ],
)
def test_metadata_json_is_parsed_strictly(tmp_path, edit, message):
    _save(tmp_path)
    metadata = json.loads((tmp_path / ".metadata.json").read_text())
    edit(metadata)
    with pytest.raises(CheckpointError, match=message):
        _dcp_json.from_json(metadata, "m.json")


def test_non_tensor_state_cannot_be_saved(tmp_path):
    with pytest.raises(CheckpointException) as caught:
        dcp.save(
            {"model": {"w": torch.ones(2)}, "note": "text"},
            storage_writer=ChecksummedWriter(tmp_path),
            no_dist=True,
        )
    (failure, _), *_ = caught.value.failures.values()
    assert isinstance(failure, CheckpointError) and "'note' is not a tensor" in str(failure)


def test_the_package_never_unpickles_a_file():
    """Audit: no pickle module, and every torch.load restricted to weights."""
    import ast
    from pathlib import Path

    import tunelab

    offenders = []
    for path in Path(tunelab.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [alias.name for alias in node.names] + [getattr(node, "module", "") or ""]
                if any(name.split(".")[0] in ("pickle", "dill", "cloudpickle") for name in names):
                    offenders.append(f"{path}:{node.lineno}: imports a pickle module")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "load":
                owner = getattr(node.func.value, "id", "")
                weights_only = any(
                    k.arg == "weights_only" and getattr(k.value, "value", None) is True
                    for k in node.keywords
                )
                if owner == "torch" and not weights_only:
                    offenders.append(f"{path}:{node.lineno}: torch.load without weights_only")
    assert offenders == []


def test_a_write_the_file_system_refuses_is_one_line_naming_the_file(tmp_path):
    # A real refusal by the kernel: a file-size limit (EFBIG, as a full disk gives ENOSPC)
    # reached while a data file is written.
    import resource
    import signal

    state = {"model": {"w": torch.randn(1 << 16)}}
    previous_signal = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, previous_limit[1]))
    try:
        with pytest.raises(CheckpointException) as caught:
            dcp.save(state, storage_writer=ChecksummedWriter(tmp_path / "step_4"), no_dist=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
        signal.signal(signal.SIGXFSZ, previous_signal)
    from tunelab.checkpoint.dcp import as_checkpoint_error

    line = str(as_checkpoint_error(caught.value, tmp_path / "step_4", "writing checkpoint"))
    assert line == (
        f"writing checkpoint {tmp_path / 'step_4'} failed: "
        f"{tmp_path / 'step_4' / '__0_0.distcp'}: File too large"
    ), line
