"""Fields a checkpoint's files hold are checked before use, end to end with ``tunelab run``.

Issue 23, finding 10: a ``trainer_state.json`` forged to ``step: -7`` (its checksum rewritten to
match, as anyone who can write the file can) emptied metrics.jsonl on resume, and a manifest
size of ``1e400`` stopped the run with a traceback instead of falling back. Now both are
refused at verification: the checkpoint is moved aside and the run resumes from the one before.
"""

import json

import pytest

from tests.recipes.conftest import (
    EVERY_2,
    STEPS,
    interrupted_copy,
    losses_by_step,
    read_metrics,
    tunelab_run,
)
from tunelab.formats import integrity

pytestmark = pytest.mark.slow
COMMON = EVERY_2


def _run(out, *extra):
    return tunelab_run(
        "lora_finetune_distributed", "tiny/lora", f"output_dir={out}", *COMMON, *extra
    )


@pytest.fixture(scope="module")
def reference(lora_2p_every_2):
    return lora_2p_every_2


def _rewrite_manifest(step_dir, change):
    path = step_dir / integrity.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _resume_falls_back_to_step_2(out, reference, problem):
    lines = (reference / "logs" / "metrics.jsonl").read_text().splitlines()
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n")  # steps logged so far
    result = _run(out, "checkpoint.resume_from_checkpoint=true")
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    warnings = [line for line in output.splitlines() if "skipping checkpoint" in line]
    assert len(warnings) == 1 and "step_4, which failed verification" in warnings[0], output
    assert problem in warnings[0], warnings[0]
    assert "resumed from step_2 (epoch 0, step 2 of 6)" in output, output
    # Every step's metrics are there once: nothing was purged by a forged step.
    steps = [record["step"] for record in read_metrics(out) if "loss" in record]
    assert steps == list(range(1, STEPS + 1)), steps
    reference_losses = losses_by_step(reference)
    for step, loss in losses_by_step(out).items():
        assert abs(loss - reference_losses[step]) <= 1e-6, (step, loss, reference_losses[step])


def test_a_forged_trainer_state_with_a_matching_checksum_falls_back(reference, tmp_path):
    out = interrupted_copy(reference, tmp_path / "run", after_step=4)
    state_path = out / "step_4" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state["step"] = -7
    forged = json.dumps(state).encode()
    state_path.write_bytes(forged)

    def rechecksum(manifest):
        manifest["files"]["trainer_state.json"] = integrity.record_of(forged)

    _rewrite_manifest(out / "step_4", rechecksum)
    assert integrity.verify_folder(out / "step_4") == []  # its checksums match: forged well
    _resume_falls_back_to_step_2(out, reference, "step -7 is not the folder's step 4")


@pytest.mark.parametrize("size", ["1e400", "-1"])
def test_a_manifest_with_an_impossible_size_falls_back(reference, tmp_path, size):
    out = interrupted_copy(reference, tmp_path / "run", after_step=4)
    path = out / "step_4" / integrity.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["files"]["trainer_state.json"]["size"] = "SIZE"
    path.write_text(json.dumps(manifest).replace('"SIZE"', size))
    _resume_falls_back_to_step_2(out, reference, "manifest record is malformed")
