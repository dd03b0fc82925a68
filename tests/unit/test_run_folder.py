"""RunFolder: the one owner of output_dir (names, lock first, links, what clean-up may touch)."""

import hashlib
import os

import pytest

from tunelab.errors import CheckpointError
from tunelab.formats import integrity, layout
from tunelab.lifecycle import RunFolder
from tunelab.lifecycle.output_lock import _held, lock_output_dir
from tunelab.lifecycle.run_folder import MARKER_NAME


def _committed_step(root, step):
    path = RunFolder(root).step_dir(step)
    path.mkdir(parents=True)
    record = integrity.write_bytes(path / "__0_0.distcp", b"x" * 10)
    layout.commit(path, {"step": step, "epoch": 0}, {"__0_0.distcp": record})
    return path


def _digest_tree(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_every_path_in_the_folder_is_named_by_it(tmp_path):
    run = RunFolder(tmp_path / "out")
    assert run.step_dir(7) == tmp_path / "out" / "step_7"
    assert run.epoch_dir(2) == tmp_path / "out" / "epoch_2"
    assert run.rank_log(1) == tmp_path / "out" / "logs" / "rank_1.log"
    assert run.profile_dir == tmp_path / "out" / "profile"
    assert run.lock_file == tmp_path / "out" / ".tunelab.lock"


def test_retention_never_follows_a_step_link_into_another_run(tmp_path):
    other = tmp_path / "other_run"
    _committed_step(other, 6)
    before = _digest_tree(other)
    mine = tmp_path / "mine"
    _committed_step(mine, 4)
    _committed_step(mine, 5)
    os.symlink(other / "step_6", mine / "step_6")
    run = RunFolder(mine)
    # The link is not a checkpoint of this run: not resumed, not pruned, not cleaned.
    assert [c.step for c in run.committed_checkpoints()] == [4, 5]
    assert [p.name for p in run.prune(keep_last_n=1)] == ["step_4"]
    run.remove_leftovers()
    assert _digest_tree(other) == before
    assert (mine / "step_6").is_symlink()
    # A run into such a folder stops before training, naming the link.
    with pytest.raises(CheckpointError, match="step_6 is a link"):
        run.check_before_start(True)


def test_an_epoch_link_is_refused_before_anything_is_written_through_it(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(elsewhere, out / "epoch_0")
    with pytest.raises(CheckpointError, match="epoch_0 is a link"):
        RunFolder(out).check_before_start(False)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious.txt"]


def test_clean_up_removes_only_what_tunelab_wrote(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    user = {
        out / ".env.old": "HF_TOKEN=secret",
        out / ".cache.partial": "mine",
        out / "step_1" / "train.jsonl": '{"text": "a dataset the user keeps here"}',
    }
    for path, text in user.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    killed_save = out / "step_3"
    killed_save.mkdir()
    (killed_save / "__0_0.distcp").write_bytes(b"partial")
    (killed_save / "trainer_state.json").write_text("{}")
    temporary = out / layout.temporary_name("epoch_0", "partial")
    temporary.mkdir()
    (out / "logs").mkdir()
    killed_trim = out / "logs" / layout.temporary_name("metrics.jsonl", "tmp", 4242)
    killed_trim.write_text('{"step": 1}\n')
    user[out / "logs" / "notes.txt"] = "the user's"
    (out / "logs" / "notes.txt").write_text("the user's")
    deleted = RunFolder(out).remove_leftovers()
    assert sorted(deleted) == sorted([killed_save, temporary, killed_trim])
    assert all(path.read_text() == text for path, text in user.items())
    assert "step_1 (train.jsonl)" in caplog.text  # named once, left in place


def test_a_lock_file_that_is_a_link_is_never_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / ".tunelab.lock")
    with pytest.raises(CheckpointError, match="is a link"):
        lock_output_dir(out)
    assert victim.read_text() == "precious"
    with pytest.raises(CheckpointError, match="is a link"):
        RunFolder(out).check_before_start(False)


def test_a_first_run_into_a_foreign_folder_is_refused_unless_allowed(tmp_path):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_text("jpg")
    run = RunFolder(out)
    with pytest.raises(CheckpointError, match="not made by tunelab.*output_dir_may_exist"):
        run.check_before_start(False, may_exist=False)
    run.check_before_start(False, may_exist=True)
    # A folder tunelab made (its marker) or one holding its committed checkpoints is its own.
    (out / MARKER_NAME).write_text("{}")
    run.check_before_start(False, may_exist=False)
    older = tmp_path / "older_run"
    _committed_step(older, 2)
    RunFolder(older).check_before_start(True, may_exist=False)


def test_start_takes_the_lock_before_looking_at_checkpoints(tmp_path):
    out = tmp_path / "busy"
    _committed_step(out, 2)
    lock_output_dir(out)  # this process is "the other run"
    try:
        # A second run into a busy folder that holds checkpoints is told it is busy, not
        # told to resume (which would then fail on the lock).
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        with context.Pool(1) as pool:
            message = pool.apply(_check_in_another_process, (str(out),))
        assert "is in use by another run" in message
    finally:
        os.close(_held.pop(out.resolve()))


def _check_in_another_process(out: str) -> str:
    try:
        RunFolder(out).check_before_start(False)
    except CheckpointError as error:
        return str(error)
    return "no error"


def test_a_manifest_that_is_a_fifo_or_a_link_is_unreadable_not_in_flight(tmp_path):
    out = tmp_path / "out"
    good = _committed_step(out, 1)
    fifo_step = RunFolder(out).step_dir(2)
    fifo_step.mkdir()
    os.mkfifo(fifo_step / layout.MANIFEST_NAME)
    link_step = RunFolder(out).step_dir(3)
    link_step.mkdir()
    os.symlink("/dev/zero", link_step / layout.MANIFEST_NAME)
    committed, unreadable = RunFolder(out).scan_checkpoints()  # returns: no hang on the FIFO
    assert [c.path for c in committed] == [good]
    assert [u.step for u in unreadable] == [2, 3]
    # Clean-up leaves them (they hold a manifest entry): resume moves them aside instead.
    RunFolder(out).remove_leftovers()
    assert fifo_step.is_dir() and link_step.is_dir()


def _write_steps(path, steps, extra=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f'{{"step": {s}, "value": {s}}}\n' for s in steps) + extra)


def _steps(path):
    import json

    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_trim_step_logs_keeps_each_per_step_log_up_to_the_resumed_step(tmp_path):
    from tunelab.lifecycle import STEP_LOGS

    run = RunFolder(tmp_path)
    assert {"metrics.jsonl", "completions.jsonl"} <= set(STEP_LOGS)
    for name in STEP_LOGS:  # a kill in step 8 left steps 6-8 and half a line
        _write_steps(run.step_log(name), [1, 2, 3, 4, 5, 6, 6, 7, 8], extra='{"step": 8, "va')
    other = run.logs_dir / "notes.jsonl"  # not a per-step log: never touched
    _write_steps(other, [1, 9])
    assert run.trim_step_logs(5) == {name: 5 for name in STEP_LOGS}
    for name in STEP_LOGS:
        assert _steps(run.step_log(name)) == [1, 2, 3, 4, 5]
    assert _steps(other) == [1, 9]
    assert run.trim_step_logs(5) == {}  # nothing left to drop: the files are not rewritten
    assert not [p for p in run.logs_dir.iterdir() if p.name.startswith(".")]  # no temporaries
    assert run.trim_step_logs(0) == {name: 5 for name in STEP_LOGS}  # a fresh run
    with pytest.raises(ValueError, match="not a per-step log"):
        run.step_log("notes.jsonl")


def test_a_metric_logger_built_before_the_trim_writes_into_the_trimmed_log(tmp_path):
    """A recipe builds its loggers, then trims: the logger's next record must land in the file."""
    from tunelab.training import JsonlLogger

    run = RunFolder(tmp_path)
    first = JsonlLogger(str(run.logs_dir))
    for step in (1, 2, 3, 4):
        first.log({"loss": float(step)}, step)
    first.close()
    resumed = JsonlLogger(str(run.logs_dir))
    run.trim_step_logs(2)  # rewrites the file: no handle opened before may point at the old one
    resumed.log({"loss": 30.0}, 3)
    resumed.close()
    assert _steps(run.step_log("metrics.jsonl")) == [1, 2, 3]
