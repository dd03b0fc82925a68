import json
import os

import pytest

from tunelab.errors import CheckpointError
from tunelab.formats import integrity, layout
from tunelab.lifecycle import RunFolder


def _make_step(root, step, *, committed=True, payload=b"x" * 10):
    path = RunFolder(root).step_dir(step)
    path.mkdir(parents=True)
    record = integrity.write_bytes(path / "__0_0.distcp", payload)
    if committed:
        layout.commit(path, {"step": step, "epoch": 0}, {"__0_0.distcp": record})
    return path


def test_commit_lists_files_with_sizes_and_checksums_and_is_the_marker(tmp_path):
    path = _make_step(tmp_path, 3)
    manifest = layout.read_manifest(path)
    assert manifest["step"] == 3
    assert manifest["manifest_version"] == 2 and manifest["digest"] == "xxh3_128"
    assert manifest["files"] == {
        "__0_0.distcp": {"size": 10, "ranges": [[0, 10, integrity.digest(b"x" * 10)]]}
    }
    assert integrity.problems_in(path, manifest["files"]) == []
    # No temp file is left behind by the atomic write.
    assert sorted(p.name for p in path.iterdir()) == ["__0_0.distcp", layout.MANIFEST_NAME]


def test_uncommitted_directories_are_invisible(tmp_path):
    _make_step(tmp_path, 1)
    _make_step(tmp_path, 2, committed=False)  # e.g. killed mid-write
    (tmp_path / "epoch_0").mkdir()
    assert [c.step for c in RunFolder(tmp_path).committed_checkpoints()] == [1]


def test_steps_sort_numerically(tmp_path):
    for step in (2, 10, 1):
        _make_step(tmp_path, step)
    assert [c.step for c in RunFolder(tmp_path).committed_checkpoints()] == [1, 2, 10]


def test_verify_names_truncated_missing_and_flipped_files(tmp_path):
    path = _make_step(tmp_path, 5)
    files = layout.read_manifest(path)["files"]
    (path / "__0_0.distcp").write_bytes(b"x" * 9 + b"y")  # same size, one byte differs
    assert "content differs from its checksum" in integrity.problems_in(path, files)[0]
    (path / "__0_0.distcp").write_bytes(b"x" * 4)
    assert "has 4 bytes, the manifest records 10" in integrity.problems_in(path, files)[0]
    (path / "__0_0.distcp").unlink()
    assert "is missing" in integrity.problems_in(path, files)[0]


def test_unreadable_manifest_is_reported_not_resumed(tmp_path):
    path = _make_step(tmp_path, 1)
    (path / layout.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable manifest"):
        layout.read_manifest(path)
    # ...such a directory is not offered for resume, and scan_checkpoints names it.
    assert RunFolder(tmp_path).committed_checkpoints() == []
    committed, unreadable = RunFolder(tmp_path).scan_checkpoints()
    assert committed == [] and [u.path for u in unreadable] == [path]
    assert "unreadable manifest" in unreadable[0].reason


def test_manifest_without_checksums_is_not_trusted(tmp_path):
    path = _make_step(tmp_path, 1, committed=False)
    (path / layout.MANIFEST_NAME).write_text(
        json.dumps({"manifest_version": 1, "step": 1, "files": {"__0_0.distcp": 10}})
    )
    with pytest.raises(CheckpointError, match="has no checksums"):
        layout.read_manifest(path)


def test_prune_keeps_newest_committed_and_never_touches_uncommitted(tmp_path):
    for step in (1, 2, 3):
        _make_step(tmp_path, step)
    in_flight = _make_step(tmp_path, 4, committed=False)
    deleted = RunFolder(tmp_path).prune(keep_last_n=2)
    assert [p.name for p in deleted] == ["step_1"]
    assert [c.step for c in RunFolder(tmp_path).committed_checkpoints()] == [2, 3]
    assert in_flight.is_dir()
    RunFolder(tmp_path).prune(keep_last_n=1)
    assert [c.step for c in RunFolder(tmp_path).committed_checkpoints()] == [3]
    assert in_flight.is_dir()
    with pytest.raises(ValueError):
        RunFolder(tmp_path).prune(keep_last_n=0)


def test_write_atomic_replaces_whole_file(tmp_path):
    target = tmp_path / "f.json"
    layout.write_atomic(target, json.dumps({"a": 1}).encode())
    layout.write_atomic(target, json.dumps({"a": 2}).encode())
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_move_aside_takes_a_checkpoint_out_of_resume_and_retention(tmp_path):
    path = _make_step(tmp_path, 4)
    aside = layout.move_aside(path)
    assert aside.name.startswith("step_4.corrupt-") and aside.is_dir() and not path.exists()
    assert RunFolder(tmp_path).committed_checkpoints() == []
    # The same step can fail twice: the second one gets a name of its own.
    assert layout.move_aside(_make_step(tmp_path, 4)) != aside


def test_remove_stale_deletes_only_leftovers_of_tunelab_naming(tmp_path):
    good = _make_step(tmp_path, 1)
    leftover = _make_step(tmp_path, 2, committed=False)
    export = tmp_path / "epoch_0"
    (export / "adapter").mkdir(parents=True)
    keep = [export / "model.safetensors", export / "adapter" / "adapter_config.json"]
    for path in keep:
        path.write_text("keep")
    stale = [
        tmp_path / layout.temporary_name("epoch_1", "partial"),
        tmp_path / layout.temporary_name("epoch_0", "old"),
        export / layout.temporary_name("adapter", "tmp", 1234),
        export / layout.temporary_name("adapter", "old", 99),
        export / layout.temporary_name("model.safetensors", "partial"),
        good / layout.temporary_name(layout.MANIFEST_NAME, "tmp", 42),
        tmp_path / layout.temporary_name("epoch_0", "tmp", "a1b2c3d4"),
    ]
    for path in stale:
        path.mkdir() if path.name.startswith((".adapter", ".epoch")) else path.write_text("x")
    # A user's files, some named like the temporaries of other tools.
    user_files = [
        tmp_path / ".hidden_by_user",
        tmp_path / "notes.partial",
        tmp_path / ".env.old",
        tmp_path / ".cache.partial",
        tmp_path / ".notes.tmp-12",
    ]
    for path in user_files:
        path.write_text("mine")
    deleted = RunFolder(tmp_path).remove_leftovers()
    assert sorted(deleted) == sorted([leftover, *stale])
    assert all(path.exists() for path in keep + user_files)
    assert [c.step for c in RunFolder(tmp_path).committed_checkpoints()] == [1]
    assert sorted(os.listdir(good)) == ["__0_0.distcp", layout.MANIFEST_NAME]
