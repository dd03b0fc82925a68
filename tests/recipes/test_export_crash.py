"""A process killed in the middle of a Hugging Face export never leaves a partial export over
the good one: the old folder stays byte-identical, and the next export succeeds."""

import hashlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import run_env
from tunelab.checkpoint.layout import is_temporary_name

SCRIPT = Path(__file__).with_name("export_crash_script.py")
pytestmark = pytest.mark.slow


def _digests(folder: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.iterdir())
        if path.is_file()
    }


def _export(mode: str, base: Path, out: Path, **kwargs):
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), mode, str(base), str(out)],
        env=run_env(), stdout=subprocess.PIPE, text=True, **kwargs,
    )  # fmt: skip


def test_killed_export_leaves_the_previous_one_intact(tiny_hf_model_dir, tmp_path):
    base = tiny_hf_model_dir("llama3_1", sharded=True)
    out = tmp_path / "epoch_0"
    assert _export("good", base, out).wait(timeout=120) == 0
    before = _digests(out)
    assert any(name.endswith(".safetensors") for name in before)

    stalled = _export("stall", base, out)
    try:
        assert stalled.stdout.readline().strip() == "STALLED"
    finally:
        stalled.send_signal(signal.SIGKILL)
        stalled.wait()
    assert _digests(out) == before
    first_file = sorted(base.glob("model-*.safetensors"))[0].name
    reference, exported = load_file(base / first_file), load_file(out / first_file)
    assert all(torch.equal(exported[key], reference[key]) for key in reference)

    # The next export replaces it whole, leftovers of the killed one included.
    assert _export("good", base, out).wait(timeout=120) == 0
    assert _digests(out) == before
    assert not any(is_temporary_name(path.name) for path in tmp_path.iterdir())
