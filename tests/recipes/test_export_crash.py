"""A process killed in the middle of a Hugging Face export never leaves a partial export over
the good one: the old folder stays byte-identical, and the next export succeeds."""

import hashlib
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes import export_crash_script, reexport_crash_script
from tests.recipes.conftest import run_env
from tunelab.formats.layout import is_temporary_name

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
    # The exports that are not killed run here; the one killed mid-write in a process of its own.
    base = tiny_hf_model_dir("llama3_1", sharded=True)
    out = tmp_path / "epoch_0"
    export_crash_script.export("good", base, out)
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
    export_crash_script.export("good", base, out)
    assert _digests(out) == before
    assert not any(is_temporary_name(path.name) for path in tmp_path.iterdir())


REEXPORT = Path(__file__).with_name("reexport_crash_script.py")


def _payload(folder: Path) -> dict[str, str]:
    """Digests of an export's weights and adapter (manifests name times, not content)."""
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.suffix in (".safetensors", ".json")
        and path.name not in ("tunelab_manifest.json",)
    }  # fmt: skip


def _reexport(mode: str, out: Path, stall: str):
    return subprocess.Popen(
        [sys.executable, str(REEXPORT), mode, str(out), stall],
        env=run_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def lora_exports(tmp_path_factory):
    """An old and a new LoRA export of the tiny model (adapter + merged weights differ), made
    in this process (the killed re-exports run in processes of their own)."""
    root = tmp_path_factory.mktemp("exports")
    payloads = {}
    for mode in ("old", "new"):
        reexport_crash_script.export(mode, root / mode / "epoch_0")
        payloads[mode] = _payload(root / mode / "epoch_0")
    assert payloads["old"] != payloads["new"]
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= set(
        payloads["old"]
    )
    return root, payloads


@pytest.mark.parametrize("stall", ["adapter", "weights", "swap", "between_renames"])
def test_a_killed_re_export_leaves_the_old_export_or_the_new_one_whole(
    lora_exports, tmp_path, stall
):
    from tunelab.formats.integrity import verify_folder
    from tunelab.lifecycle import RunFolder

    root, payloads = lora_exports
    run = tmp_path / "run"
    shutil.copytree(root / "old", run)
    out = run / "epoch_0"
    process = _reexport("new", out, stall)
    try:
        assert process.stdout.readline().strip() == "STALLED"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    # What the next run finds once it has cleaned up (a crash between two renames is undone).
    RunFolder(run).remove_leftovers()
    assert _payload(out) in (payloads["old"], payloads["new"])
    expected = payloads["new"] if stall == "swap" else payloads["old"]
    assert _payload(out) == expected
    assert verify_folder(out) == []
    assert sorted(p.name for p in run.iterdir()) == ["epoch_0"]
