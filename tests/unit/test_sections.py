"""Settings in typed sections, each handed whole to its owner (issue 39, items 1 and 2).

A new setting is a field in one section and one use in the code that owns the section; no
recipe changes, because every recipe hands the section over whole.
"""

import ast
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from tunelab import _paths
from tunelab.cli._discovery import load_recipe_args
from tunelab.config import LoRAFinetuneArgs, load_config, parse_args
from tunelab.config.recipe_args import CheckpointArgs
from tunelab.config.sections import ScheduleArgs
from tunelab.training.session import Schedule

FRAMEWORK = Path(__file__).resolve().parents[2] / "framework" / "tunelab"
TRAINING_RECIPES = (
    "full_finetune_distributed",
    "lora_finetune_distributed",
    "lora_dpo_distributed",
    "grpo_distributed",
)
# The sections each training recipe hands whole to their owners (build_model, data_parallel_mesh,
# Schedule, StepProfiler, RouterLoss, build_checkpoint_client, TrainingEval, and GRPO's
# ModelRolloutEngine.from_rollout, GroupSampler.from_settings, Rewards.from_settings).
HANDED_WHOLE = (
    "model", "parallelism", "schedule", "profile", "checkpoint", "eval", "router", "rollout", "rewards"
)  # fmt: skip


@dataclass(kw_only=True)
class _ScheduleWithWarmLogs(ScheduleArgs):
    """The schedule section, plus a setting a user adds."""

    log_first_n_steps: int = 0
    """Log every one of the first N steps, then every log_every_n_steps."""


class _WarmLogSchedule(Schedule):
    """The owner's one new use of the setting."""

    def log(self, global_step: int) -> bool:
        return global_step <= self.schedule.log_first_n_steps or super().log(global_step)


def _recipe_source(name: str) -> str:
    return (_paths.recipes_dir() / f"{name}.py").read_text()


def test_a_new_setting_is_a_field_in_its_section_and_one_use_in_its_owner():
    # A record whose schedule section has the new field; nothing else changes.
    settings = dataclasses.make_dataclass(
        "WarmLogArgs",
        [
            (
                "schedule",
                _ScheduleWithWarmLogs,
                dataclasses.field(default_factory=_ScheduleWithWarmLogs),
            )
        ],
        bases=(LoRAFinetuneArgs,),
        kw_only=True,
    )
    cfg = load_config(
        "tiny/lora",
        ["output_dir=/tmp/unused", "schedule.log_first_n_steps=3", "schedule.log_every_n_steps=5"],
        settings,
    )
    args = parse_args(cfg, settings)
    # The recipe's own line, as it is written in every training recipe, builds the owner.
    for name in TRAINING_RECIPES:
        call = "Schedule(args.schedule, args.checkpoint)"
        assert call in _recipe_source(name), name
    schedule = eval(  # noqa: S307 - the recipe's own expression, with the extended owner
        call, {"Schedule": _WarmLogSchedule, "args": args}
    )
    assert [step for step in range(1, 13) if schedule.log(step)] == [1, 2, 3, 5, 10]
    # The same line without the new setting behaves as before.
    plain = Schedule(ScheduleArgs(log_every_n_steps=5), CheckpointArgs())
    assert [step for step in range(1, 13) if plain.log(step)] == [5, 10]


def test_each_training_recipe_hands_its_sections_whole():
    for name in TRAINING_RECIPES:
        tree = ast.parse(_recipe_source(name))
        record = load_recipe_args(_paths.recipes_dir() / f"{name}.py")
        sections = [s for s in HANDED_WHOLE if s in {f.name for f in dataclasses.fields(record)}]
        whole = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for argument in [*node.args, *(keyword.value for keyword in node.keywords)]:
                    if (
                        isinstance(argument, ast.Attribute)
                        and isinstance(argument.value, ast.Name)
                        and argument.value.id == "args"
                    ):
                        whole.add(argument.attr)
        assert set(sections) <= whole, (name, sorted(set(sections) - whole))


def test_a_recipe_has_only_the_sections_it_uses():
    # Nothing is refused by inheritance: DPO and GRPO have no router section, no context
    # parallelism and no activation offloading, so those keys are simply not there.
    full, lora, dpo, grpo = (
        load_recipe_args(_paths.recipes_dir() / f"{name}.py") for name in TRAINING_RECIPES
    )
    fields = {
        record: {f.name for f in dataclasses.fields(record)} for record in (full, lora, dpo, grpo)
    }
    assert "router" in fields[full] and "router" in fields[lora]
    assert "router" not in fields[dpo] and "router" not in fields[grpo]
    for record in (dpo, grpo):
        hints = {f.name: f.type for f in dataclasses.fields(record)}
        section_fields = {f.name for f in dataclasses.fields(hints["parallelism"])}
        assert "context_parallel_size" not in section_fields
        assert "offload_activations" not in {f.name for f in dataclasses.fields(hints["model"])}
    source = (FRAMEWORK / "config" / "recipe_args.py").read_text()
    assert "FinetuneArgs.check_settings(self)" not in source and "_NO_" not in source


def test_no_getattr_probes_of_a_settings_object_outside_the_generic_checks():
    # The CLI and the config package check any record generically; lifecycle.entry reports a
    # failure for whatever record a copied recipe declares. Nothing else probes settings.
    allowed = {FRAMEWORK / "cli", FRAMEWORK / "config"}
    allowed_files = {FRAMEWORK / "lifecycle" / "entry.py"}
    probe = re.compile(r"getattr\(\s*(args|settings|cfg|config|self\.args|recipe_args)\b")
    found = []
    for path in FRAMEWORK.rglob("*.py"):
        if path in allowed_files or any(folder in path.parents for folder in allowed):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if probe.search(line):
                found.append(f"{path.relative_to(FRAMEWORK)}:{number}: {line.strip()}")
    for name in TRAINING_RECIPES:
        if probe.search(_recipe_source(name)):
            found.append(name)
    assert not found
