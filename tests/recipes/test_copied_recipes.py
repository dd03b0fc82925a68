"""A copied recipe stands alone: its own settings dataclass, the building blocks unchanged.

Each training recipe is copied with the real ``tunelab cp`` and edited the way a user would:
it declares its own settings dataclass (not a subclass of the built-in settings) that drops a
setting the copy no longer uses (the ``profile`` section: the copy never profiles) and adds one of its
own (``greeting``, printed at start). The copy then runs through the real ``tunelab run`` on 2
processes, and must train exactly like the built-in recipe with the same config: the same
losses, step for step, as the shared 2-process runs of the built-in recipes (``lora_2p``,
``full_2p``, ``dpo_2p`` in conftest.py).
"""

import subprocess

import pytest

from tests.recipes.conftest import COMMON, TUNELAB, losses_by_step, run_env, tunelab_run

# The edits a user makes to the copy: its own dataclass in place of the built-in ARGS.
_OWN_SETTINGS = '''
import dataclasses

from tunelab.config import RecipeArgs


def _own_settings(builtin):
    """A dataclass of its own: the built-in fields minus ``profile``, plus ``greeting``."""
    kept = [
        (f.name, f.type, f) for f in dataclasses.fields(builtin) if f.name not in ("profile",)
    ]
    greeting = ("greeting", str, dataclasses.field(default="hello from my copy"))
    # The fields with defaults come after the required ones, as a dataclass needs.
    kept.sort(key=lambda item: item[2].default is dataclasses.MISSING
              and item[2].default_factory is dataclasses.MISSING, reverse=True)
    return dataclasses.make_dataclass(
        "MySettings", [*kept, greeting], bases=(RecipeArgs,), kw_only=True
    )


ARGS = _own_settings({builtin})
'''

# Each recipe, its config and settings class, the shared run of the built-in recipe it is
# compared with, and the settings of that run (DPO: its first 3 of 40 steps, in warm-up).
RECIPES = [
    ("full_finetune_distributed", "tiny/full", "FullFinetuneArgs", "full_2p",
     ("schedule.batch_size=8", *COMMON)),
    ("lora_finetune_distributed", "tiny/lora", "LoRAFinetuneArgs", "lora_2p",
     ("schedule.batch_size=8", *COMMON)),
    ("lora_dpo_distributed", "tiny/lora_dpo", "LoRADPOArgs", "dpo_2p",
     ("schedule.max_steps_per_epoch=3", "checkpoint.save_every_n_steps=2")),
]  # fmt: skip


def _copy(recipe: str, builtin: str, path) -> None:
    subprocess.run([TUNELAB, "cp", recipe, str(path)], check=True, env=run_env())
    text = path.read_text()
    profiler = "StepProfiler(run.profile_dir, args.profile)"
    assert f"\nARGS = {builtin}\n" in text and profiler in text
    text = text.replace(f"\nARGS = {builtin}\n", _OWN_SETTINGS.format(builtin=builtin))
    # The copy drops the `profile` section (it never profiles) and uses its own `greeting`.
    text = text.replace(profiler, "StepProfiler(run.profile_dir, ProfileArgs())")
    anchor = "\nfrom tunelab.config import "
    assert anchor in text
    text = text.replace(anchor, "\nfrom tunelab.config.sections import ProfileArgs" + anchor, 1)
    start = "    device = dist_info.device\n"
    assert start in text
    text = text.replace(start, start + "    print(args.greeting, flush=True)\n")
    path.write_text(text)


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, config, builtin, reference, settings", RECIPES, ids=[r[0] for r in RECIPES]
)
def test_a_copy_with_its_own_settings_dataclass_trains_like_the_builtin(
    recipe, config, builtin, reference, settings, tmp_path, request
):
    copy = tmp_path / "my_recipe.py"
    _copy(recipe, builtin, copy)
    mine = tmp_path / "mine"
    result = tunelab_run(str(copy), config, f"output_dir={mine}", *settings)
    assert "hello from my copy" in result.stdout
    theirs = request.getfixturevalue(reference)
    theirs = losses_by_step(theirs[0] if isinstance(theirs, tuple) else theirs)
    ours = losses_by_step(mine)
    assert len(ours) >= 3 and ours == {step: theirs[step] for step in ours}
    # The copy's own checkpoint and export came from the same building blocks.
    assert any(mine.glob("step_*")) and (mine / "epoch_0").is_dir()
    # A setting it dropped is an unknown key for the copy, named as such.
    refused = tunelab_run(
        str(copy), config, f"output_dir={tmp_path / 'x'}", "profile.enabled=true", check=False
    )
    assert refused.returncode != 0 and "unknown key 'profile'" in refused.stderr
