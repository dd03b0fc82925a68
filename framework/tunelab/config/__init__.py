"""Configs: YAML load, overrides, ``_component_`` instantiation, typed and strict recipe settings.

A config is a YAML file (a built-in one by name, e.g. ``tiny/lora``, or any path). A recipe
declares its settings as a ``RecipeArgs`` dataclass, with the values each allows on its type
(``Annotated[int, Range(ge=1)]``, see ``constraints``); ``parse_args`` checks a config against
it and ``instantiate`` builds the swappable parts (``_component_`` nodes). The built-in
recipes' settings (``LoRAFinetuneArgs``, ...) are exported here for copied recipes to use or
subclass.

Nothing here imports torch, so checking a config stays fast.
"""

from tunelab.config._args import Component, RecipeArgs, component, field_docs
from tunelab.config._instantiate import import_component, instantiate
from tunelab.config._load import apply_overrides, builtin_configs, load_config, resolve_config_path
from tunelab.config._validate import parse_args, validate
from tunelab.config.constraints import (
    Constraint,
    ExistingPath,
    Finite,
    ModelDir,
    NonEmpty,
    OneOf,
    OutputDir,
    PathCheck,
    Range,
    TokenizerPath,
)
from tunelab.config.distill import DistillArgs, OnPolicyArgs, TeacherArgs
from tunelab.config.recipe_args import (
    CheckpointArgs,
    EvalArgs,
    FinetuneArgs,
    FullFinetuneArgs,
    GenerateArgs,
    GRPOArgs,
    LoRAArgs,
    LoRADPOArgs,
    LoRAFinetuneArgs,
    LoRAKTOArgs,
    RewardModelArgs,
    TrainingEvalArgs,
)

__all__ = [
    "CheckpointArgs",
    "Component",
    "Constraint",
    "DistillArgs",
    "EvalArgs",
    "ExistingPath",
    "FinetuneArgs",
    "Finite",
    "FullFinetuneArgs",
    "GenerateArgs",
    "GRPOArgs",
    "LoRAArgs",
    "LoRADPOArgs",
    "LoRAKTOArgs",
    "LoRAFinetuneArgs",
    "ModelDir",
    "NonEmpty",
    "OneOf",
    "OnPolicyArgs",
    "OutputDir",
    "PathCheck",
    "Range",
    "RecipeArgs",
    "RewardModelArgs",
    "TeacherArgs",
    "TokenizerPath",
    "TrainingEvalArgs",
    "apply_overrides",
    "builtin_configs",
    "component",
    "field_docs",
    "import_component",
    "instantiate",
    "load_config",
    "parse_args",
    "resolve_config_path",
    "validate",
]
