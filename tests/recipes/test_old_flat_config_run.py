"""A config written before the settings had sections still runs, and trains exactly like its
migrated twin (issue 39, item 3: the old flat keys work for one release).

tests/fixtures/flat_configs/ holds the shipped configs as they were; each old key is mapped to
its section where the config is loaded (file and overrides), said once by the launcher in one
line, and the run is the same run: the same losses and the same exported tensors, bit for bit.
"""

import hashlib
from pathlib import Path

import pytest

from tests.recipes.conftest import losses_by_step, read_metrics, shipped_config_run, tunelab_run
from tunelab._paths import configs_dir

FLAT = Path(__file__).resolve().parents[1] / "fixtures" / "flat_configs"
NOTICE = "(old flat key; it works until the next release)"


def _export_hashes(output_dir: Path) -> dict[str, str]:
    return {
        str(path.relative_to(output_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(output_dir.glob("epoch_*/**/*.safetensors"))
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "name"),
    [("lora_finetune_distributed", "tiny/lora"), ("grpo_distributed", "tiny/grpo")],
)
def test_an_old_flat_config_trains_like_its_migrated_twin(recipe, name, tmp_path, tmp_path_factory):
    old_dir = tmp_path / "old"
    # The old config with old-key overrides; its twin is the shipped config with the same
    # settings in new keys, the run test_quiet_runs makes (shared: made once per session).
    old = tunelab_run(
        recipe, str(FLAT / f"{name}.yaml"), f"output_dir={old_dir}", "epochs=1",
        "max_steps_per_epoch=2",
    )  # fmt: skip
    twin, code, output = shipped_config_run(tmp_path_factory, configs_dir() / f"{name}.yaml")
    assert code == 0, output[-4000:]
    new_dir = twin / "out"
    notices = [line for line in old.stderr.splitlines() if line.endswith(NOTICE)]
    assert "tunelab: checkpoint_dir -> model.path " + NOTICE in notices
    assert "tunelab: max_steps_per_epoch -> schedule.max_steps_per_epoch " + NOTICE in notices
    # Once each, from the launcher only (not once per rank), though the key is in the file
    # and in an override.
    assert len(notices) == len(set(notices))
    assert losses_by_step(old_dir) == losses_by_step(new_dir)
    assert len(read_metrics(new_dir)) >= 2
    hashes = _export_hashes(new_dir)
    assert hashes and _export_hashes(old_dir) == hashes
