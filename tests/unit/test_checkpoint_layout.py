import json

import pytest

from tunelab.checkpoint import layout
from tunelab.errors import CheckpointError


def _make_step(root, step, *, committed=True, payload=b"x" * 10):
    path = layout.step_dir(root, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(payload)
    if committed:
        layout.commit(path, {"step": step, "epoch": 0})
    return path


def test_commit_lists_files_with_sizes_and_is_the_marker(tmp_path):
    path = _make_step(tmp_path, 3)
    manifest = layout.read_manifest(path)
    assert manifest["step"] == 3
    assert manifest["files"] == {"__0_0.distcp": 10}
    assert layout.verify(path, manifest) is None
    # No temp file is left behind by the atomic write.
    assert sorted(p.name for p in path.iterdir()) == ["__0_0.distcp", layout.MANIFEST_NAME]


def test_uncommitted_directories_are_invisible(tmp_path):
    _make_step(tmp_path, 1)
    _make_step(tmp_path, 2, committed=False)  # e.g. killed mid-write
    (tmp_path / "epoch_0").mkdir()
    assert [c.step for c in layout.committed_checkpoints(tmp_path)] == [1]


def test_steps_sort_numerically(tmp_path):
    for step in (2, 10, 1):
        _make_step(tmp_path, step)
    assert [c.step for c in layout.committed_checkpoints(tmp_path)] == [1, 2, 10]


def test_verify_names_truncated_and_missing_files(tmp_path):
    path = _make_step(tmp_path, 5)
    manifest = layout.read_manifest(path)
    (path / "__0_0.distcp").write_bytes(b"x" * 4)
    assert "has 4 bytes, the manifest recorded 10" in layout.verify(path, manifest)
    (path / "__0_0.distcp").unlink()
    assert "is missing" in layout.verify(path, manifest)


def test_unreadable_manifest_is_a_clear_error(tmp_path):
    path = _make_step(tmp_path, 1)
    (path / layout.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable checkpoint manifest"):
        layout.read_manifest(path)
    # ...and such a directory is not offered for resume.
    assert layout.committed_checkpoints(tmp_path) == []


def test_prune_keeps_newest_committed_and_never_touches_uncommitted(tmp_path):
    for step in (1, 2, 3):
        _make_step(tmp_path, step)
    in_flight = _make_step(tmp_path, 4, committed=False)
    deleted = layout.prune(tmp_path, keep_last_n=2)
    assert [p.name for p in deleted] == ["step_1"]
    assert [c.step for c in layout.committed_checkpoints(tmp_path)] == [2, 3]
    assert in_flight.is_dir()
    layout.prune(tmp_path, keep_last_n=1)
    assert [c.step for c in layout.committed_checkpoints(tmp_path)] == [3]
    assert in_flight.is_dir()
    with pytest.raises(ValueError):
        layout.prune(tmp_path, keep_last_n=0)


def test_write_atomic_replaces_whole_file(tmp_path):
    target = tmp_path / "f.json"
    layout.write_atomic(target, json.dumps({"a": 1}).encode())
    layout.write_atomic(target, json.dumps({"a": 2}).encode())
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]
