"""Constraints on settings, component rules, and reading components and ARGS without torch."""

import dataclasses
import importlib
import inspect
import json
import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import pytest
from omegaconf import OmegaConf

from tunelab import _paths
from tunelab.cli import builtin_recipes, load_recipe_args
from tunelab.config import RecipeArgs, parse_args, validate
from tunelab.config._component_rules import DATA_SUFFIXES, LOADERS, RULES, TEMPLATE_NAMES
from tunelab.config._instantiate import inspect_component
from tunelab.config._static import (
    HAS_DEFAULT,
    StaticCallable,
    StaticMissing,
    resolve_static,
    supported_model_types,
)
from tunelab.config._types import TypeMismatch, coerce, type_name
from tunelab.config.constraints import (
    ExistingPath,
    Finite,
    NonEmpty,
    OneOf,
    OutputDir,
    Range,
    suggest_path,
    writable_dir_problem,
)
from tunelab.errors import ConfigError

ENV = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")

# --- value constraints -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("constraint", "text", "allowed", "refused"),
    [
        (Range(ge=1), ">= 1", [1, 2, 10**9], [0, -1, 0.5, "1", True, None]),
        (Range(gt=0), "> 0", [1e-9, 3], [0, -1e-9, math.nan]),
        (Range(ge=0, lt=1), "in [0, 1)", [0, 0.0, 0.999], [1, 1.0, -0.1, math.nan]),
        (Range(gt=0, le=0.5), "in (0, 0.5]", [0.5, 0.1], [0, 0.6]),
        (Range(le=-1), "<= -1", [-1, -5], [0]),
        (Finite(), "finite", [0, -3.5, 1e300], [math.inf, -math.inf, math.nan, "x"]),
        (NonEmpty(), "non-empty", ["a", [1], {"k": 1}], ["", "   ", [], {}]),
        (OneOf("a", "b"), "one of 'a' | 'b'", ["a", "b"], ["c", "A", 1]),
        (OneOf(1, 2), "one of 1 | 2", [1, 2], [True, 1.0, 3]),
    ],
)
def test_value_constraints(constraint, text, allowed, refused):
    assert constraint.describe() == text
    assert all(constraint.allows(value) for value in allowed)
    assert not any(constraint.allows(value) for value in refused)


def test_range_needs_one_bound_on_each_side_at_most():
    with pytest.raises(ValueError):
        Range()
    with pytest.raises(ValueError):
        Range(ge=0, gt=0)
    with pytest.raises(ValueError):
        OneOf()


Positive = Annotated[float, Finite(), Range(gt=0)]


@pytest.mark.parametrize(
    ("hint", "value", "message"),
    [
        (Annotated[int, Range(ge=1)], 0, "expected int >= 1, got 0"),
        (Annotated[int, Range(ge=1)] | None, 0, "expected int >= 1 | None, got 0"),
        (Annotated[int, Range(ge=1)] | None, "x", "expected int >= 1 | None, got str 'x'"),
        (Positive, "fast", "expected finite float > 0, got str 'fast'"),
        (Positive, -1, "expected finite float > 0, got -1"),
        (Positive, math.inf, "expected finite float > 0, got inf"),
        (Annotated[float, Range(ge=0, lt=1)], 1.5, "expected float in [0, 1), got 1.5"),
        (Annotated[str, NonEmpty()], "", "expected non-empty str, got ''"),
        (Annotated[list[str], NonEmpty()], [], "expected non-empty list[str], got []"),
        (
            Annotated[str, OneOf("llama3", "chatml")],
            "lama3",
            "expected one of 'llama3' | 'chatml', got 'lama3'; did you mean 'llama3'?",
        ),
    ],
)
def test_coerce_names_the_rule_and_the_value(hint, value, message):
    with pytest.raises(TypeMismatch) as info:
        coerce(value, hint)
    assert str(info.value) == message


def test_coerce_converts_before_checking_and_keeps_good_values():
    assert coerce(3, Positive) == 3.0 and isinstance(coerce(3, Positive), float)
    assert coerce(None, Annotated[int, Range(ge=1)] | None) is None
    assert coerce([0.9, 0.99], tuple[Annotated[float, Range(lt=1)], float]) == (0.9, 0.99)
    assert type_name(Annotated[str, NonEmpty(), OutputDir()]) == "non-empty str"


# --- path checks -----------------------------------------------------------------------------


def test_suggest_path_fixes_the_first_missing_part(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sft.jsonl").write_text("{}")
    assert suggest_path(tmp_path / "data" / "sft.jsnol") == str(tmp_path / "data" / "sft.jsonl")
    assert suggest_path(tmp_path / "dat" / "sft.jsonl") == str(tmp_path / "data" / "sft.jsonl")
    assert suggest_path(tmp_path / "data" / "zzzzzz") is None
    assert suggest_path(tmp_path / "data" / "sft.jsonl") is None  # It exists.


def test_writable_dir_problem(tmp_path):
    file = tmp_path / "file"
    file.write_text("x")
    assert writable_dir_problem(tmp_path) is None
    assert writable_dir_problem(tmp_path / "new" / "deeper") is None
    assert writable_dir_problem(file) == f"{file} is a file, expected a folder"
    assert writable_dir_problem(file / "sub") == f"cannot create {file / 'sub'}: {file} is a file"


def test_existing_path(tmp_path):
    (tmp_path / "adapter").mkdir()
    check = ExistingPath("dir", contains=("adapter_config.json",))
    assert check.problems(str(tmp_path / "adapter")) == [
        f"{tmp_path / 'adapter'} has no adapter_config.json"
    ]
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    assert check.problems(str(tmp_path / "adapter")) == []
    assert check.problems(str(tmp_path / "adaptr")) == [
        f"folder not found: {tmp_path / 'adaptr'}; did you mean '{tmp_path / 'adapter'}'?"
    ]


# --- settings: constraints, cross-section did-you-mean, check_settings -------------------------


@dataclass(kw_only=True)
class Inner:
    every_n: Annotated[int, Range(ge=1)] | None = None
    """How often."""


@dataclass(kw_only=True)
class Settings(RecipeArgs):
    out: Annotated[str, NonEmpty(), OutputDir()] = "out"
    """Output folder."""
    log_every_n: Annotated[int, Range(ge=1)] = 1
    """Log interval."""
    inner: Inner = field(default_factory=Inner)
    """Nested."""
    low: int = 0
    """Must not exceed high."""
    high: int = 1
    """Must not be below low."""

    def check_settings(self) -> list[str]:
        problems = super().check_settings()
        if self.low > self.high:
            problems.append(f"key 'low': {self.low} is above high ({self.high})")
        return problems


def _cfg(**values):
    return OmegaConf.create({"recipe": "x", **values})


def test_constraints_apply_to_settings_and_nested_settings(tmp_path):
    assert validate(_cfg(log_every_n=0, inner={"every_n": -5}), Settings) == [
        "key 'log_every_n': expected int >= 1, got 0",
        "key 'inner.every_n': expected int >= 1 | None, got -5",
    ]
    file = tmp_path / "a_file"
    file.write_text("")
    assert validate(_cfg(out=str(file)), Settings) == [
        f"key 'out': {file} is a file, expected a folder"
    ]
    args = parse_args(_cfg(out=str(tmp_path / "new"), inner={"every_n": 3}), Settings)
    assert args.inner.every_n == 3


def test_unknown_key_suggests_the_same_name_in_another_section():
    # The close top-level key (log_every_n) must not win over the exact name in `inner`.
    assert validate(_cfg(every_n=3), Settings) == [
        "unknown key 'every_n' in config; did you mean 'inner.every_n'?"
    ]
    assert validate(_cfg(inner={"log_every_n": 3}), Settings) == [
        "unknown key 'inner.log_every_n' in config; did you mean 'log_every_n'?"
    ]
    assert validate(_cfg(inner={"evry_n": 3}), Settings) == [
        "unknown key 'inner.evry_n' in config; did you mean 'inner.every_n'?"
    ]


def test_check_settings_runs_once_every_setting_is_valid():
    assert validate(_cfg(low=3, high=2), Settings) == ["key 'low': 3 is above high (2)"]
    with pytest.raises(ConfigError, match="above high"):
        parse_args(_cfg(low=3, high=2), Settings)
    # A single-setting problem is reported alone: the settings object is never built.
    assert validate(_cfg(low=3, high=2, log_every_n=0), Settings) == [
        "key 'log_every_n': expected int >= 1, got 0"
    ]


# --- reading components from source ----------------------------------------------------------


def _public_callables():
    for package in ("tunelab.data", "tunelab.training", "tunelab.losses", "tunelab.peft"):
        module = importlib.import_module(package)
        for name in module.__all__:
            target = getattr(module, name)
            if callable(target) and not isinstance(target, dict):
                yield f"{package}.{name}", target


def _shape(signature):
    return [
        (p.name, p.kind, p.default is inspect.Parameter.empty)
        for p in signature.parameters.values()
    ]


def test_static_signatures_match_the_imported_objects():
    compared = 0
    for dotted, target in _public_callables():
        found = resolve_static(dotted)
        assert not isinstance(found, StaticMissing), dotted
        if found is None:
            continue  # Undecidable from the source: the import route handles it.
        assert found.name == f"{target.__module__}.{target.__qualname__}", dotted
        assert _shape(found.signature) == _shape(inspect.signature(target)), dotted
        compared += 1
    assert compared >= 20


def test_static_lookup_reports_a_missing_name_like_the_import():
    with pytest.raises(ConfigError) as static:
        inspect_component("tunelab.training.adamx", "optimizer._component_")
    assert str(static.value) == (
        "optimizer._component_: cannot import 'tunelab.training.adamx': 'tunelab.training' has "
        "no attribute 'adamx'; did you mean 'tunelab.training.adamw'?"
    )
    found = resolve_static("tunelab.training.adamw")
    assert isinstance(found, StaticCallable)
    assert found.signature.parameters["lr"].default is HAS_DEFAULT


def test_static_lookup_defers_what_it_cannot_know():
    assert resolve_static("torch.optim.AdamW") is None
    assert resolve_static("tunelab.training") is None  # A module, not a callable.
    assert inspect_component("collections.Counter")[0] == "collections.Counter"


# Rules known to name an argument the callable does not take (a defect to fix in
# config/_component_rules.py, not here): chat_dataset has no column_map (its rule copies the
# instruct builders' _DATASET), so the value goes through **load_dataset_kwargs to
# datasets.load_dataset, which has no such argument either.
_KNOWN_BAD_RULES: dict[str, str] = {}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.xfail(
                strict=True, reason=f"rule names {_KNOWN_BAD_RULES[name]!r}, not an argument"
            ),
        )
        if name in _KNOWN_BAD_RULES
        else name
        for name in RULES
    ],
)
def test_every_component_rule_names_a_real_argument(name):
    # A named parameter of the callable itself: a **kwargs catch-all (forwarded to
    # datasets.load_dataset or wandb.init) would accept any name, so it vouches for none.
    found_name, signature = inspect_component(name)
    assert found_name == name
    named = {
        key
        for key, parameter in signature.parameters.items()
        if parameter.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    }
    for argument in RULES[name].args:
        assert argument in named, (name, argument)


def test_rule_choices_match_the_data_package():
    from tunelab.data import TEMPLATES, sources

    assert set(TEMPLATE_NAMES) == {"auto", *TEMPLATES}
    assert set(LOADERS) == set(sources._LOADERS)
    assert set(DATA_SUFFIXES) == set(sources._SUFFIX_TO_LOADER) | {sources.ARROW_SUFFIX}


def test_supported_model_types_read_from_source_match_the_package():
    from tunelab.models.families import FAMILIES

    assert supported_model_types() == {
        name: family.adapter.architecture for name, family in FAMILIES.items()
    }


# --- ARGS without importing the recipe, and no torch on the config path ----------------------


def _python(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=cwd,
    )


def test_config_cli_and_builtin_args_do_not_import_torch():
    result = _python(
        """
        import sys
        import tunelab.config, tunelab.cli, tunelab.config.recipe_args
        from tunelab.cli import builtin_recipes, load_recipe_args
        from tunelab.cli._check import check_config
        names = [load_recipe_args(path).__name__ for path in builtin_recipes().values()]
        check_config("tiny/lora", ["output_dir=/tmp/unused_tunelab_out"])
        print(names, "torch" in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("False"), result.stdout


COPIED_RECIPE = '''
import helper_next_to_me
from dataclasses import dataclass
from tunelab.config import RecipeArgs

@dataclass(kw_only=True)
class MyArgs(RecipeArgs):
    steps: int = helper_next_to_me.STEPS
    """Steps."""

ARGS = MyArgs
'''


def test_copied_recipe_with_its_own_args_is_imported(tmp_path):
    (tmp_path / "helper_next_to_me.py").write_text("STEPS = 7\n")
    (tmp_path / "mine.py").write_text(COPIED_RECIPE)
    args_cls = load_recipe_args(tmp_path / "mine.py")
    assert args_cls.__name__ == "MyArgs"
    assert {f.name: f.default for f in dataclasses.fields(args_cls)}["steps"] == 7
    assert str(tmp_path) not in sys.path


def test_args_reassigned_later_is_not_read_from_the_source(tmp_path):
    (tmp_path / "r.py").write_text(
        "from tunelab.config.recipe_args import GenerateArgs, LoRAFinetuneArgs\n"
        "ARGS = GenerateArgs\n"
        "if True:\n"
        "    ARGS = LoRAFinetuneArgs\n"
    )
    assert load_recipe_args(tmp_path / "r.py").__name__ == "LoRAFinetuneArgs"


def test_builtin_recipes_args_read_from_source_equal_the_imported_ones():
    for path in builtin_recipes().values():
        spec = importlib.util.spec_from_file_location(f"_check_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert load_recipe_args(path) is module.ARGS


def test_model_dir_of_the_embedded_tiny_model_is_clean():
    from tunelab.config._model_dir import model_dir_problems

    assert model_dir_problems(str(_paths.assets_dir() / "tiny")) == []


def test_hub_cache_folder_name_gives_the_repo(tmp_path):
    from tunelab.config._model_dir import repo_hint

    folder = tmp_path / "models--someorg--SomeModel-7B" / "snapshots" / "abc"
    assert repo_hint(folder) == "someorg/SomeModel-7B"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text(json.dumps({"_name_or_path": "org/name"}))
    assert repo_hint(tmp_path / "mine") == "org/name"
    assert repo_hint(tmp_path / "Qwen2.5-3B") == "Qwen/Qwen2.5-3B"
    assert repo_hint(tmp_path / "whatever") is None
