"""Strict validation of configs against typed recipe settings."""

from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from tunelab.config import (
    Component,
    RecipeArgs,
    component,
    field_docs,
    instantiate,
    parse_args,
    validate,
)
from tunelab.errors import ConfigError


@dataclass
class LoRAArgs:
    rank: int = 8
    """The rank of the low-rank update."""
    alpha: float = 16.0
    """The scale numerator: the update is scaled by alpha / rank."""
    targets: list[str] = field(default_factory=lambda: ["q_proj"])
    """Module names to adapt."""


@dataclass(kw_only=True)
class ToyArgs(RecipeArgs):
    output_dir: str
    """Where checkpoints go."""
    epochs: int = 1
    """Passes over the data."""
    lr: float = 1e-3
    """Peak learning rate."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter dtype."""
    seed: int | None = None
    """Random seed; None picks one."""
    compile: bool = False
    """Whether to torch.compile."""
    lora: LoRAArgs = field(default_factory=LoRAArgs)
    """LoRA settings."""
    optimizer: Component = component(call_args=("params",))
    """The optimizer; the recipe passes params."""
    wrapper: Component | None = component(required=False, call_args=("text",))
    """A text function; the recipe passes text."""
    loggers: list[Component] = component(required=False)
    """Metric loggers."""


def base(**changes):
    cfg = {
        "recipe": "toy",
        "output_dir": "/tmp/out",
        "optimizer": {"_component_": "torch.optim.SGD", "lr": 0.1},
    }
    cfg.update(changes)
    return OmegaConf.create(cfg)


def problems_of(cfg):
    return validate(cfg, ToyArgs)


def test_valid_config_gives_typed_args():
    cfg = base(
        lr=1,
        optimizer={"_component_": "torch.optim.SGD", "lr": "${lr}"},
        epochs=3,
        lora={"rank": 4, "targets": ["q_proj", "v_proj"]},
        seed=7,
    )
    args = parse_args(cfg, ToyArgs)
    assert isinstance(args, ToyArgs)
    assert args.lr == 1.0 and isinstance(args.lr, float)
    assert (args.epochs, args.seed, args.dtype, args.compile) == (3, 7, "fp32", False)
    assert args.lora == LoRAArgs(rank=4, alpha=16.0, targets=["q_proj", "v_proj"])
    assert args.wrapper is None
    assert args.loggers == []
    assert isinstance(args.optimizer, DictConfig)
    optimizer = instantiate(args.optimizer, params=[torch.nn.Parameter(torch.ones(1))])
    assert optimizer.param_groups[0]["lr"] == 1


def test_misspelled_top_level_key_suggests_closest():
    cfg = base(optimiser={"_component_": "torch.optim.SGD"})
    with pytest.raises(ConfigError) as info:
        parse_args(cfg, ToyArgs)
    assert str(info.value) == "unknown key 'optimiser' in config; did you mean 'optimizer'?"


def test_misspelled_nested_key_suggests_closest():
    assert problems_of(base(lora={"rnak": 4})) == [
        "unknown key 'lora.rnak' in config; did you mean 'lora.rank'?"
    ]


def test_unknown_key_without_close_match():
    assert problems_of(base(zzz=1)) == ["unknown key 'zzz' in config"]


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"epochs": "two"}, "key 'epochs': expected int, got str 'two'"),
        ({"epochs": True}, "key 'epochs': expected int, got bool True"),
        ({"epochs": 1.5}, "key 'epochs': expected int, got float 1.5"),
        ({"compile": 1}, "key 'compile': expected bool, got int 1"),
        ({"dtype": "fp16"}, "key 'dtype': expected one of 'fp32' | 'bf16', got str 'fp16'"),
        ({"seed": "x"}, "key 'seed': expected int | None, got str 'x'"),
        ({"lora": {"targets": [1]}}, "key 'lora.targets': expected str, got int 1"),
        ({"lora": 5}, "key 'lora': expected a mapping of LoRAArgs settings, got int 5"),
        ({"output_dir": "???"}, "key 'output_dir' has no value (???): set it, e.g. output_dir=..."),
        ({"recipe": ["a"]}, "key 'recipe': expected str, got list ['a']"),
    ],
)
def test_type_errors_name_key_expected_and_got(changes, problem):
    assert problems_of(base(**changes)) == [problem]


def test_missing_required_key_shows_its_docstring():
    cfg = base()
    del cfg["output_dir"]
    assert problems_of(cfg) == ["missing required key 'output_dir' (Where checkpoints go.)"]
    del cfg["optimizer"]
    assert "missing required key 'optimizer' (The optimizer; the recipe passes params.)" in (
        problems_of(cfg)
    )


def test_required_component_cannot_be_null():
    assert problems_of(base(optimizer=None)) == [
        "key 'optimizer' is required: expected a node with _component_, got null"
    ]


def test_component_node_needs_component_key():
    assert problems_of(base(optimizer={"lr": 1})) == [
        "key 'optimizer': expected a node with _component_: <dotted.path>, got {'lr': 1}"
    ]


def test_unknown_component_is_reported_with_path():
    problems = problems_of(base(optimizer={"_component_": "torch.optim.SGDD"}))
    assert problems == [
        "optimizer._component_: cannot import 'torch.optim.SGDD': 'torch.optim' has no "
        "attribute 'SGDD'; did you mean 'torch.optim.SGD'?"
    ]


def test_component_argument_not_in_signature():
    problems = problems_of(base(optimizer={"_component_": "torch.optim.SGD", "lrr": 0.1}))
    assert problems == [
        "key 'optimizer.lrr': torch.optim.SGD has no argument 'lrr'; did you mean 'optimizer.lr'?"
    ]


def test_call_args_must_not_be_set_in_config():
    problems = problems_of(base(optimizer={"_component_": "torch.optim.SGD", "params": []}))
    assert problems == [
        "key 'optimizer.params': the recipe passes 'params' itself; remove it from the config"
    ]


def test_missing_required_component_argument():
    problems = problems_of(base(wrapper={"_component_": "textwrap.indent"}))
    assert problems == ["key 'wrapper': missing required argument 'prefix' of textwrap.indent"]
    assert problems_of(base(wrapper={"_component_": "textwrap.indent", "prefix": "> "})) == []


def test_component_that_does_not_take_call_args():
    problems = problems_of(base(optimizer={"_component_": "textwrap.dedent", "text": "x"}))
    assert problems == [
        "key 'optimizer': textwrap.dedent takes no argument 'params', which the recipe passes"
    ]


def test_nested_components_are_checked_recursively():
    wrapper = {
        "_component_": "textwrap.indent",
        "prefix": "> ",
        "predicate": {"_component_": "textwrap.nosuch"},
    }
    problems = problems_of(base(wrapper=wrapper))
    assert len(problems) == 1
    assert problems[0].startswith("wrapper.predicate._component_: cannot import 'textwrap.nosuch'")


def test_list_of_components():
    loggers = [
        {"_component_": "collections.Counter"},
        {"_component_": "textwrap.TextWrapper", "widht": 10},
    ]
    args_problems = problems_of(base(loggers=loggers))
    assert args_problems == [
        "key 'loggers.1.widht': textwrap.TextWrapper has no argument 'widht'; "
        "did you mean 'loggers.1.width'?"
    ]
    assert problems_of(base(loggers={"_component_": "collections.Counter"})) == [
        "key 'loggers': expected a list of nodes with _component_, got DictConfig"
    ]
    args = parse_args(base(loggers=loggers[:1]), ToyArgs)
    assert [type(instantiate(node)).__name__ for node in args.loggers] == ["Counter"]


def test_broken_interpolation_is_a_problem():
    problems = problems_of(base(output_dir="${nowhere}"))
    assert len(problems) == 1 and problems[0].startswith("key 'output_dir': ")
    assert "nowhere" in problems[0]


def test_several_problems_one_per_line():
    cfg = base(epochs="x", optimiser=1, lora={"alpah": 2})
    with pytest.raises(ConfigError) as info:
        parse_args(cfg, ToyArgs)
    assert str(info.value).splitlines() == [
        "3 problems in the config:",
        "  - unknown key 'optimiser' in config; did you mean 'optimizer'?",
        "  - key 'epochs': expected int, got str 'x'",
        "  - unknown key 'lora.alpah' in config; did you mean 'lora.alpha'?",
    ]


def test_field_docs_reads_attribute_docstrings_including_inherited():
    docs = field_docs(ToyArgs)
    assert docs["lr"] == "Peak learning rate."
    assert docs["recipe"].startswith("The recipe this config belongs to")
    assert set(docs) == {f for f in ToyArgs.__dataclass_fields__}


@dataclass
class PartlyDocumented:
    documented: int = 1
    """Has a docstring."""
    undocumented: int = 2
    other: str = "x"
    """Belongs to other, not to undocumented."""


def test_field_docs_omits_undocumented_fields():
    assert field_docs(PartlyDocumented) == {
        "documented": "Has a docstring.",
        "other": "Belongs to other, not to undocumented.",
    }


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("resume=auto", "checkpoint.resume_from_checkpoint"),
        ("checkpoint.resume=auto", "checkpoint.resume_from_checkpoint"),
        ("accumulation=2", "schedule.gradient_accumulation_steps"),
        ("save_every=3", "checkpoint.save_every_n_steps"),
    ],
)
def test_a_word_of_a_longer_key_suggests_that_key_in_any_section(override, suggestion):
    # A character-ratio match misses `resume` for `resume_from_checkpoint`; a word of the last
    # part of a dotted key finds it.
    from tunelab.config import LoRAFinetuneArgs, load_config

    problems = validate(load_config("tiny/lora", [override], LoRAFinetuneArgs), LoRAFinetuneArgs)
    key = override.partition("=")[0]
    assert problems == [f"unknown key '{key}' in config; did you mean '{suggestion}'?"]


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("lr=1e-3", "optimizer.lr"),
        ("warmup=5", "lr_scheduler.num_warmup_steps"),
        ("log_dir=x", "metric_loggers.0.log_dir"),
    ],
)
def test_an_argument_of_a_component_is_suggested_by_its_name(override, suggestion):
    from tunelab.config import LoRAFinetuneArgs, load_config

    problems = validate(load_config("tiny/lora", [override], LoRAFinetuneArgs), LoRAFinetuneArgs)
    key = override.partition("=")[0]
    assert problems == [f"unknown key '{key}' in config; did you mean '{suggestion}'?"]
