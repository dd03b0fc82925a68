"""The building blocks a training recipe calls take at most 6 parameters (issue 39, Proof).

The recipes are read with ``ast``: every ``tunelab`` callable a training recipe imports and calls
(directly or through ``functools.partial``) is inspected. Settings go in as their sections
(``ScheduleArgs``, ``CheckpointArgs``) and collaborators as small records (``Datasets``,
``TrainState``, ``StepReports``), so none takes more.
"""

import ast
import importlib
import inspect

from tunelab import _paths

TRAINING_RECIPES = (
    "full_finetune_distributed",
    "lora_finetune_distributed",
    "lora_dpo_distributed",
    "grpo_distributed",
)
MAX_PARAMETERS = 6


def _called_blocks(recipe: str) -> dict[str, object]:
    """``module.name`` -> callable, for every tunelab import the recipe calls."""
    tree = ast.parse((_paths.recipes_dir() / f"{recipe}.py").read_text())
    imported = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tunelab"):
            for alias in node.names:
                imported[alias.asname or alias.name] = (node.module, alias.name)
    called = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        names = [node.func] + (node.args[:1] if getattr(node.func, "id", "") == "partial" else [])
        for name in names:
            if isinstance(name, ast.Name) and name.id in imported:
                module, attribute = imported[name.id]
                called[f"{module}.{attribute}"] = getattr(
                    importlib.import_module(module), attribute
                )
            # A classmethod of an imported class: `GroupSampler.from_settings(...)`.
            if (
                isinstance(name, ast.Attribute)
                and isinstance(name.value, ast.Name)
                and name.value.id in imported
            ):
                module, attribute = imported[name.value.id]
                owner = getattr(importlib.import_module(module), attribute)
                called[f"{module}.{attribute}.{name.attr}"] = getattr(owner, name.attr)
    return called


def _parameter_count(block: object) -> int | None:
    try:
        signature = inspect.signature(block)
    except (TypeError, ValueError):
        return None
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return sum(1 for p in signature.parameters.values() if p.kind not in variadic)


def test_the_building_blocks_recipes_call_take_at_most_six_parameters():
    too_many = {}
    for recipe in TRAINING_RECIPES:
        for name, block in _called_blocks(recipe).items():
            count = _parameter_count(block)
            if count is not None and count > MAX_PARAMETERS:
                too_many[name] = count
    assert not too_many, f"over {MAX_PARAMETERS} parameters: {too_many}"
