"""An installed wheel carries the built-in recipes, configs and the embedded tiny assets,
and the CLI finds them through the package (not through a checkout)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (path,) = out.glob("tunelab-*.whl")
    return path


def test_wheel_contains_builtins_and_assets(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "tunelab/_builtin/recipes/lora_finetune_distributed.py" in names
    assert "tunelab/_builtin/configs/tiny/lora.yaml" in names
    assert "tunelab/assets/tiny/model.safetensors" in names
    assert "tunelab/assets/tiny/tokenizer.json" in names
    assert "tunelab/assets/tiny_eval/next_number.jsonl" in names  # tiny/eval's local tasks


def test_cli_finds_builtins_in_an_unpacked_wheel(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # Run from an empty folder with the unpacked wheel first on the path: no checkout in sight.
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    code = (
        "import tunelab, tunelab._paths as p, sys; "
        "print(tunelab.__file__); print(p.recipes_dir()); print(p.configs_dir())"
    )
    where = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(line.startswith(str(site)) for line in where), where
    listing = subprocess.run(
        [sys.executable, "-m", "tunelab.cli", "ls"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "lora_finetune_distributed" in listing and "tiny/lora" in listing
    validated = subprocess.run(
        [sys.executable, "-m", "tunelab.cli", "validate", "tiny/lora"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert validated.returncode == 0, validated.stderr
