"""Checkpoints that cannot be turned against the user, end to end with the real ``tunelab run``
on 2 processes: checksums and the fallback that continues, files that would run code if they
were unpickled, exact resume with LoRA dropout, stale temporary files, and write failures that
leave the committed checkpoints intact."""

import hashlib
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.recipes.conftest import (
    EVERY_2,
    STEPS,
    TUNELAB,
    interrupted_copy,
    limit_file_size,
    losses_by_step,
    run_env,
    tunelab_run,
)
from tunelab.formats.layout import temporary_name

pytestmark = pytest.mark.slow
COMMON = EVERY_2


class _Payload:
    """Unpickling this creates ``marker``: what a crafted checkpoint file would try."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _run(out, *extra, check=True):
    return tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", *COMMON, *extra, check=check
    )


def _digests(folder: Path) -> dict[str, str]:
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _assert_same_losses(actual, expected, steps, tol=1e-6):
    for step in steps:
        assert abs(actual[step] - expected[step]) <= tol, (step, actual[step], expected[step])


@pytest.fixture(scope="module")
def reference(lora_2p_every_2):
    return lora_2p_every_2


# The dropout run commits every step: the never-unpickled test needs four committed checkpoints.
DROPOUT = ("lora.dropout=0.05", "checkpoint.save_every_n_steps=1")


@pytest.fixture(scope="module")
def dropout_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("dropout_reference")
    _run(out, *DROPOUT)
    return out


def test_every_output_verifies_and_a_flipped_byte_is_named(reference):
    result = subprocess.run(
        [TUNELAB, "verify", str(reference)], capture_output=True, text=True, env=run_env()
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == [
        "ok", str(reference / "epoch_0"), *[w for s in (2, 4, 6) for w in ("ok", str(reference / f"step_{s}"))]
    ]  # fmt: skip
    manifest = json.loads((reference / "step_6" / "tunelab_manifest.json").read_text())
    assert {".metadata.json", "trainer_state.json", "__0_0.distcp", "__1_0.distcp"} == set(
        manifest["files"]
    )
    # Every output follows the umask (the adapter used to be written 0600 through mkdtemp).
    umask = os.umask(0)
    os.umask(umask)
    for path in reference.rglob("*"):
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert path.stat().st_mode & 0o777 == expected, (path, oct(path.stat().st_mode))
    adapter_manifest = reference / "epoch_0" / "adapter" / "tunelab_manifest.json"
    assert set(json.loads(adapter_manifest.read_text())["files"]) == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }


def test_corrupt_newest_checkpoint_is_moved_aside_and_the_run_finishes_exactly(reference, tmp_path):
    out = interrupted_copy(reference, tmp_path / "run", after_step=4)
    data = out / "step_4" / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit, same size
    data.write_bytes(bytes(raw))
    verify = subprocess.run(
        [TUNELAB, "verify", str(out / "step_4")], capture_output=True, text=True
    )
    assert verify.returncode == 1
    # The range named is the one item (and its padding) that holds the flipped byte.
    manifest = json.loads((out / "step_4" / "tunelab_manifest.json").read_text())
    ((start, length, _),) = [
        piece
        for piece in manifest["files"]["__1_0.distcp"]["ranges"]
        if piece[0] <= len(raw) // 2 < piece[0] + piece[1]
    ]
    assert verify.stdout.strip() == (
        f"FAILED {data}: content differs from its checksum (bytes {start}..{start + length})"
    )

    result = _run(out, "checkpoint.resume_from_checkpoint=true")
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    warnings = [line for line in output.splitlines() if "skipping checkpoint" in line]
    assert len(warnings) == 1 and "step_4, which failed verification" in warnings[0]
    assert "__1_0.distcp: content differs from its checksum" in warnings[0]
    assert "resumed from step_2 (epoch 0, step 2 of 6)" in output
    moved = [path.name for path in out.iterdir() if path.name.startswith("step_4.corrupt-")]
    assert len(moved) == 1
    # Reaching step 4 again committed a new step_4; the losses equal the uninterrupted run's.
    _assert_same_losses(losses_by_step(out), losses_by_step(reference), range(3, STEPS + 1))
    for step in (2, 4, 6):
        assert (out / f"step_{step}" / "tunelab_manifest.json").is_file()
    assert subprocess.run([TUNELAB, "verify", str(out / "step_4")]).returncode == 0


def test_files_that_would_run_code_are_never_executed(dropout_reference, tmp_path):
    # Four committed checkpoints (step_1 to step_4); in each, one file resume reads is
    # replaced by a pickle whose loading would create the marker.
    out = interrupted_copy(dropout_reference, tmp_path / "run", after_step=4)
    marker = tmp_path / "marker"
    payload = pickle.dumps(_Payload(marker))
    for step, name in (
        (4, "tunelab_manifest.json"),
        (3, ".metadata.json"),
        (2, "trainer_state.json"),
        (1, "__0_0.distcp"),
    ):
        (out / f"step_{step}" / name).write_bytes(payload)
    (out / "step_4" / ".metadata").write_bytes(payload)  # DCP's own name: never read
    assert not (out / "epoch_0").exists() and not (out / "logs").exists()
    result = _run(out, *DROPOUT, "checkpoint.resume_from_checkpoint=true", check=False)
    output = result.stdout + result.stderr
    assert not marker.exists()
    assert result.returncode == 1 and "Traceback" not in output
    error = [line for line in output.splitlines() if line.startswith("tunelab: error:")]
    assert len(error) == 1 and "no intact committed checkpoint" in error[0]
    for step, name in ((4, "unreadable manifest"), (3, ".metadata.json"), (2, "trainer_state"),
                       (1, "__0_0.distcp")):  # fmt: skip
        assert f"step_{step} (" in error[0] and name in error[0], (step, error[0])
    assert not any(path.name.startswith("step_") and "." not in path.name for path in out.iterdir())


def test_exact_resume_with_lora_dropout(dropout_reference, reference, tmp_path):
    dropped, plain = losses_by_step(dropout_reference), losses_by_step(reference)
    assert any(abs(dropped[s] - plain[s]) > 1e-4 for s in range(2, STEPS + 1))  # dropout is on
    out = interrupted_copy(dropout_reference, tmp_path / "run", after_step=2)
    _run(out, *DROPOUT, "checkpoint.resume_from_checkpoint=true")
    resumed = losses_by_step(out)
    assert sorted(resumed) == [3, 4, 5, 6]
    _assert_same_losses(resumed, dropped, range(3, STEPS + 1))


@pytest.fixture(scope="module")
def crashed_and_resumed(reference, tmp_path_factory) -> tuple[Path, list[Path], str]:
    """The reference run as a crash right after committing step 4 leaves it, then resumed.

    The crash had logged steps 5 and 6 (and a line cut short), left temporaries of a save and
    of an export behind, and an uncommitted step_6 holding what a save writes. One resume, with
    ``resume_from_checkpoint=auto`` (the command line that starts a run fresh when there is no
    checkpoint), serves the three tests below; returns its folder, the temporaries it found and
    what it printed.
    """
    out = interrupted_copy(reference, tmp_path_factory.mktemp("crashed") / "run", after_step=4)
    logs = out / "logs"
    logs.mkdir()
    lines = (reference / "logs" / "metrics.jsonl").read_text().splitlines()
    (logs / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 7, "lo')
    shutil.copytree(reference / "epoch_0", out / "epoch_0")
    stale = [
        out / "epoch_0" / temporary_name("adapter", "tmp", 4242),
        out / temporary_name("epoch_0", "partial"),
        out / "step_4" / temporary_name("trainer_state.json", "tmp", 77),
    ]
    for path in stale:
        path.mkdir()
        (path / "junk").write_text("x")
    (out / "step_6").mkdir()
    (out / "step_6" / "__0_0.distcp").write_text("x")
    resumed = _run(out, "checkpoint.resume_from_checkpoint=auto")
    return out, stale, resumed.stdout


def test_metrics_hold_each_step_once_after_a_resume(reference, crashed_and_resumed):
    out, _, _ = crashed_and_resumed

    def shape(path):
        return [(r["step"], sorted(r)) for r in map(json.loads, path.read_text().splitlines())]

    # Each step's records once, in order: the same records as the uninterrupted run's.
    assert shape(out / "logs" / "metrics.jsonl") == shape(reference / "logs" / "metrics.jsonl")


def test_stale_temporaries_are_removed_and_never_exported(crashed_and_resumed):
    out, stale, _ = crashed_and_resumed
    assert not any(path.exists() for path in stale)
    names = {p.relative_to(out).as_posix() for p in out.rglob("*")}
    assert not any("junk" in name or ".tunelab-" in name for name in names)
    assert subprocess.run([TUNELAB, "verify", str(out)]).returncode == 0


def test_write_failures_are_one_line_and_leave_committed_checkpoints_intact(reference, tmp_path):
    out = interrupted_copy(reference, tmp_path / "run", after_step=2)
    before = _digests(out / "step_2")
    # No file may grow past 500 kB (the kernel refuses with EFBIG, "File too large"): the
    # resumed run's step_4 shards are ~0.7 MB each, so its first save fails mid-write.
    command = [TUNELAB, "run", "--nproc_per_node", "2", "lora_finetune_distributed", "--config",
               "tiny/lora", f"output_dir={out}", *COMMON, "checkpoint.resume_from_checkpoint=true"]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, env=run_env(), timeout=600,
        preexec_fn=limit_file_size(500_000),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output, output[-3000:]
    error = [line for line in output.splitlines() if line.startswith("tunelab: error:")]
    assert len(error) == 1, output[-3000:]
    assert "step_4" in error[0] and "File too large" in error[0]
    assert _digests(out / "step_2") == before
    assert not (out / "step_4" / "tunelab_manifest.json").exists()
    # The export (a 2.2 MB model.safetensors) fails the same way once the saves fit.
    out = interrupted_copy(reference, tmp_path / "run2", after_step=4)
    before = {step: _digests(out / f"step_{step}") for step in (2, 4)}
    command = [f"output_dir={out}" if c.startswith("output_dir=") else c for c in command]
    result = subprocess.run(
        command, capture_output=True, text=True, env=run_env(), timeout=600,
        preexec_fn=limit_file_size(1_500_000),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output, output[-3000:]
    error = [line for line in output.splitlines() if line.startswith("tunelab: error:")]
    assert len(error) == 1 and "epoch_0" in error[0] and "File too large" in error[0], output
    assert {step: _digests(out / f"step_{step}") for step in (2, 4)} == before
    assert not (out / "epoch_0" / "model.safetensors").exists()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1.7 MB tmpfs (a real full disk); skipped where mounting is not permitted."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1700k", "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=False)


def test_full_disk_is_one_line_and_the_committed_checkpoint_stays_intact(small_tmpfs):
    out = small_tmpfs / "run"
    # step_2 (~1.1 MB) fits; step_4 does not: ENOSPC in the middle of its shards.
    result = _run(out, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output, output[-3000:]
    error = [line for line in output.splitlines() if line.startswith("tunelab: error:")]
    assert len(error) == 1 and "step_4" in error[0], output[-3000:]
    assert "No space left on device" in error[0]
    assert not (out / "step_4" / "tunelab_manifest.json").exists()
    verify = subprocess.run(
        [TUNELAB, "verify", str(out / "step_2")], capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout


def test_resume_auto_starts_fresh_or_resumes_and_true_needs_a_checkpoint(
    reference, crashed_and_resumed, tmp_path
):
    out = tmp_path / "run"
    result = _run(out, "checkpoint.resume_from_checkpoint=true", check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output
    assert [line for line in output.splitlines() if line.startswith("tunelab: error:")] == [
        f"tunelab: error: checkpoint.resume_from_checkpoint=true but {out} holds no committed "
        "checkpoint: set it to auto to start fresh when there is none"
    ]
    # auto into an empty folder starts fresh and says so; the same command line resumes later
    # (the crashed run's resume above: the reference's copy, killed after step_4).
    fresh = _run(out, "checkpoint.resume_from_checkpoint=auto")
    assert f"no checkpoint in {out}: starting fresh" in fresh.stdout
    _assert_same_losses(losses_by_step(out), losses_by_step(reference), range(1, STEPS + 1))
    again, _, resumed_stdout = crashed_and_resumed
    assert "resumed from step_4 (epoch 0, step 4 of 6)" in resumed_stdout
    _assert_same_losses(losses_by_step(again), losses_by_step(out), range(5, STEPS + 1))
