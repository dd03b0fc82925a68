"""Strict validation of a config against a recipe's settings dataclass.

Besides keys and types, every value is held to the constraints declared on its type
(``Annotated[int, Range(ge=1)]``, see ``constraints``), the arguments of the built-in components
to their rules (``_component_rules``), and paths to their checks (a model folder, a dataset
file, an output folder). Components are looked up without importing torch where the source says
enough (``_static``), so this stays fast enough to run before every launch.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from tunelab.config._args import ComponentSpec, RecipeArgs, component_spec, field_docs
from tunelab.config._component_rules import RULES, ComponentRules
from tunelab.config._instantiate import COMPONENT_KEY, inspect_component
from tunelab.config._types import TypeMismatch, coerce, split_annotated
from tunelab.config.constraints import PathCheck
from tunelab.errors import ConfigError, first_line

T = TypeVar("T")
_NO_VALUE = object()
_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _join(path: str, key: str | int) -> str:
    return f"{path}.{key}" if path else str(key)


def _suggest(key: str, known: typing.Iterable[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"; did you mean '{_join(prefix, close[0])}'?" if close else ""


def _dataclass_of(hint: Any) -> type | None:
    """Return the dataclass a field holds (``Args`` or ``Args | None``), else None."""
    hint = split_annotated(hint)[0]
    candidates = [hint, *typing.get_args(hint)] if typing.get_origin(hint) else [hint]
    for candidate in candidates:
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _is_list(hint: Any) -> bool:
    hint = split_annotated(hint)[0]
    return typing.get_origin(hint) in (list, tuple, typing.Sequence) or any(
        typing.get_origin(arg) is list for arg in typing.get_args(hint)
    )


def _path_checks(hint: Any) -> list[PathCheck]:
    """The path checks of a hint: ``Annotated[str, ModelDir()]``, also inside ``X | None``."""
    inner, constraints = split_annotated(hint)
    found = [c for c in constraints if isinstance(c, PathCheck)]
    if typing.get_origin(inner) in (typing.Union, types.UnionType):
        for arm in typing.get_args(inner):
            found.extend(_path_checks(arm))
    return found


def key_paths(cls: type, prefix: str = "") -> list[str]:
    """Every settings key of a dataclass, nested dataclasses included (``checkpoint.x``)."""
    paths = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        path = _join(prefix, field.name)
        paths.append(path)
        nested = _dataclass_of(hints[field.name])
        if nested is not None and component_spec(field) is None:
            paths.extend(key_paths(nested, path))
    return paths


def component_argument_keys(cfg: DictConfig) -> list[str]:
    """The argument keys of the config's top-level components (``optimizer.lr``, ``metric_loggers.0.log_dir``)."""
    keys = []
    for name in cfg.keys():
        try:
            node = cfg[name]
            nodes = list(enumerate(node)) if isinstance(node, ListConfig) else [(None, node)]
        except OmegaConfBaseException:
            continue  # Reported where the key is checked.
        for index, item in nodes:
            if isinstance(item, DictConfig) and COMPONENT_KEY in item.keys():
                prefix = _join(str(name), index) if index is not None else str(name)
                keys += [_join(prefix, str(key)) for key in item.keys() if key != COMPONENT_KEY]
    return keys


class _Checker:
    """Walks a config and a dataclass tree together, collecting every problem."""

    def __init__(self, root: type | None = None, cfg: DictConfig | None = None) -> None:
        self.problems: list[str] = []
        self.bad_paths: set[str] = set()
        # Every key of the whole settings tree, so a key in the wrong section finds its place;
        # and the arguments the config gives its components (`lr` -> `optimizer.lr`).
        self.all_keys = key_paths(root) if root is not None else []
        if cfg is not None:
            self.all_keys += component_argument_keys(cfg)

    def suggest_key(self, key: str, path: str, here: typing.Iterable[str]) -> str:
        """A did-you-mean for an unknown key: the same name in another section first."""
        wrong = _join(path, key)
        elsewhere = [p for p in self.all_keys if p.rpartition(".")[2] == key and p != wrong]
        if elsewhere:
            return f"; did you mean '{min(elsewhere, key=len)}'?"
        close = _suggest(key, here, path)
        if close:
            return close
        leaves: dict[str, str] = {}  # Last name -> full key; the shortest key of a name wins.
        for candidate in sorted(self.all_keys, key=len, reverse=True):
            leaves[candidate.rpartition(".")[2]] = candidate
        # A word of a longer name (`resume` for `resume_from_checkpoint`), which a
        # character-ratio match misses when the rest of the name is long.
        words = [leaf for leaf in leaves if key in leaf.split("_") and key != leaf]
        if words:
            return f"; did you mean '{min((leaves[leaf] for leaf in words), key=len)}'?"
        match = difflib.get_close_matches(key, list(leaves), n=1)
        return f"; did you mean '{leaves[match[0]]}'?" if match else ""

    def read(self, node: DictConfig | ListConfig, key: Any, path: str) -> Any:
        """Read one child with interpolations resolved; record a problem and return _NO_VALUE."""
        try:
            return node[key]
        except MissingMandatoryValue:
            self.problems.append(f"key '{path}' has no value (???): set it, e.g. {path}=...")
        except OmegaConfBaseException as err:
            self.problems.append(f"key '{path}': {first_line(err)}")
        return _NO_VALUE

    def plain(self, value: Any, path: str) -> Any:
        if not isinstance(value, (DictConfig, ListConfig)):
            return value
        try:
            return OmegaConf.to_container(value, resolve=True, throw_on_missing=True)
        except OmegaConfBaseException as err:
            self.problems.append(f"key '{path}': {first_line(err)}")
            return _NO_VALUE

    def dataclass(self, node: DictConfig, cls: type, path: str) -> Any:
        fields = {field.name: field for field in dataclasses.fields(cls) if field.init}
        hints = typing.get_type_hints(cls, include_extras=True)
        for key in node.keys():
            if key not in fields:
                self.problems.append(
                    f"unknown key '{_join(path, key)}' in config"
                    + self.suggest_key(str(key), path, fields)
                )
        kwargs: dict[str, Any] = {}
        for name, field in fields.items():
            key_path = _join(path, name)
            spec = component_spec(field)
            if name not in node.keys():  # `in` is False for ??? values
                if (
                    field.default is dataclasses.MISSING
                    and field.default_factory is dataclasses.MISSING
                ):
                    doc = field_docs(cls).get(name)
                    self.problems.append(
                        f"missing required key '{key_path}'" + (f" ({doc})" if doc else "")
                    )
                elif spec is not None and _is_list(hints[name]) and field.default is None:
                    kwargs[name] = []
                continue
            value = self.read(node, name, key_path)
            if value is _NO_VALUE:
                continue
            if spec is not None:
                kwargs[name] = self.component_field(value, hints[name], spec, key_path)
            elif (nested := _dataclass_of(hints[name])) is not None and value is not None:
                if not isinstance(value, DictConfig):
                    self.problems.append(
                        f"key '{key_path}': expected a mapping of {nested.__name__} settings, "
                        f"got {type(value).__name__} {value!r}"
                    )
                    continue
                kwargs[name] = self.dataclass(value, nested, key_path)
            else:
                value = self.plain(value, key_path)
                if value is _NO_VALUE:
                    continue
                try:
                    kwargs[name] = coerce(value, hints[name])
                except TypeMismatch as err:
                    self.problems.append(f"key '{key_path}': {err}")
                    continue
                self.check_paths(kwargs[name], hints[name], key_path)
        if self.problems:
            return None
        return cls(**kwargs)

    def check_paths(self, value: Any, hint: Any, path: str) -> None:
        if value is None or not isinstance(value, (str, Path)):
            return
        # `tokenizer.path: ${checkpoint_dir}` is the same folder: one message about it is enough.
        where = os.path.abspath(os.path.expanduser(value))
        if where in self.bad_paths:
            return
        for check in _path_checks(hint):
            problems = check.problems(str(value))
            if problems:
                self.bad_paths.add(where)
            self.problems.extend(f"key '{path}': {problem}" for problem in problems)

    def component_field(self, value: Any, hint: Any, spec: ComponentSpec, path: str) -> Any:
        many = _is_list(hint)
        if value is None:
            if spec.required:
                expected = "a list of nodes" if many else "a node"
                self.problems.append(
                    f"key '{path}' is required: expected {expected} with {COMPONENT_KEY}, got null"
                )
            return [] if many else None
        if not many:
            self.component(value, path, spec.call_args, spec.called_later)
            return value
        if not isinstance(value, ListConfig):
            self.problems.append(
                f"key '{path}': expected a list of nodes with {COMPONENT_KEY}, "
                f"got {type(value).__name__}"
            )
            return value
        for index, item in enumerate(value):
            self.component(item, _join(path, index), spec.call_args, spec.called_later)
        return list(value)

    def component(
        self, node: Any, path: str, call_args: tuple[str, ...], called_later: bool = False
    ) -> None:
        if not isinstance(node, DictConfig) or COMPONENT_KEY not in node:
            self.problems.append(
                f"key '{path}': expected a node with {COMPONENT_KEY}: <dotted.path>, "
                f"got {self.plain(node, path)!r}"
            )
            return
        dotted = self.read(node, COMPONENT_KEY, _join(path, COMPONENT_KEY))
        if dotted is _NO_VALUE:
            return
        try:
            name, signature = inspect_component(dotted, _join(path, COMPONENT_KEY))
        except ConfigError as err:
            self.problems.append(str(err))
            return
        keys = [str(key) for key in node.keys() if key != COMPONENT_KEY]
        self.signature(signature, dotted, keys, path, call_args, called_later)
        children = {key: self.read(node, key, _join(path, key)) for key in keys}
        rules = RULES.get(name)
        if rules is not None:
            self.component_arguments(rules, children, path)
        for key, child in children.items():
            if child is not _NO_VALUE:
                self.nested_components(child, _join(path, key))

    def component_arguments(
        self, rules: ComponentRules, children: dict[str, Any], path: str
    ) -> None:
        """Hold a built-in component's arguments to its rules (``_component_rules``)."""
        values: dict[str, Any] = {}
        refused = False
        for key, child in children.items():
            if child is _NO_VALUE:
                refused = True
                continue
            if isinstance(child, DictConfig) and COMPONENT_KEY in child:
                continue  # A nested component; checked on its own.
            value = self.plain(child, _join(path, key))
            if value is _NO_VALUE:
                refused = True
                continue
            values[key] = value
            if key not in rules.args:
                continue
            try:
                converted = coerce(value, rules.args[key])
            except TypeMismatch as err:
                self.problems.append(f"key '{_join(path, key)}': {err}")
                refused = True
                continue
            self.check_paths(converted, rules.args[key], _join(path, key))
        if rules.check is not None and not refused:
            for key, problem in rules.check(values):
                self.problems.append(f"key '{_join(path, key)}': {problem}")

    def nested_components(self, value: Any, path: str) -> None:
        """Check components inside a component's arguments; these get no call-site args."""
        if isinstance(value, DictConfig):
            if COMPONENT_KEY in value:
                self.component(value, path, ())
                return
            for key in value.keys():
                self.nested_components(self.read(value, key, _join(path, key)), _join(path, key))
        elif isinstance(value, ListConfig):
            for index in range(len(value)):
                self.nested_components(
                    self.read(value, index, _join(path, index)), _join(path, index)
                )
        else:
            self.plain(value, path)

    def signature(
        self,
        signature: inspect.Signature | None,
        dotted: str,
        keys: list[str],
        path: str,
        call_args: tuple[str, ...],
        called_later: bool = False,
    ) -> None:
        if signature is None:
            return  # No signature to check against (some builtins).
        params = signature.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        by_keyword = [name for name, p in params.items() if p.kind in _BY_KEYWORD]
        for key in keys:
            if key in call_args:
                self.problems.append(
                    f"key '{_join(path, key)}': the recipe passes '{key}' itself; "
                    "remove it from the config"
                )
            elif key not in by_keyword and not takes_any:
                self.problems.append(
                    f"key '{_join(path, key)}': {dotted} has no argument '{key}'"
                    + _suggest(key, by_keyword, path)
                )
        for name in call_args:
            if name not in by_keyword and not takes_any:
                self.problems.append(
                    f"key '{path}': {dotted} takes no argument '{name}', which the recipe passes"
                )
        for name, param in params.items():
            if param.kind in _BY_KEYWORD or param.kind is inspect.Parameter.POSITIONAL_ONLY:
                given = name in keys or name in call_args or called_later
                if param.default is inspect.Parameter.empty and not given:
                    self.problems.append(
                        f"key '{path}': missing required argument '{name}' of {dotted}"
                    )


def validate(cfg: DictConfig, args_cls: type) -> list[str]:
    """Return every problem of a config against a recipe's settings dataclass.

    Checks unknown keys (with the closest known key, in any section), missing required keys,
    value types and the constraints declared on them (``Annotated[int, Range(ge=1)]``), the
    paths they name (``ModelDir``, ``OutputDir``, ...), every ``_component_`` (it must exist,
    its config arguments must be in its signature and follow the component's rules, and its
    required arguments must be given by the config or the recipe), and the settings'
    ``check_settings()``.

    Args:
        cfg: The loaded config (overrides applied).
        args_cls: The recipe's ``RecipeArgs`` subclass.

    Returns:
        One message per problem; empty when the config is valid.
    """
    checker = _Checker(args_cls, cfg)
    args = checker.dataclass(cfg, args_cls, "")
    if isinstance(args, RecipeArgs):
        checker.problems.extend(args.check_settings())
    return checker.problems


def parse_args(cfg: DictConfig, args_cls: type[T]) -> T:
    """Validate a config strictly and return the recipe's typed settings.

    Scalars are converted to the field types; nested dataclasses are built; component fields
    keep their ``DictConfig`` node (a list of nodes for list fields), ready for ``instantiate``.

    Args:
        cfg: The loaded config (overrides applied).
        args_cls: The recipe's ``RecipeArgs`` subclass.

    Returns:
        An instance of ``args_cls``.

    Raises:
        ConfigError: Listing every problem, one per line, if the config does not validate.
    """
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"a config is a mapping of keys to values, got {type(cfg).__name__}")
    checker = _Checker(args_cls, cfg)
    args = checker.dataclass(cfg, args_cls, "")
    if isinstance(args, RecipeArgs):
        checker.problems.extend(args.check_settings())
    if checker.problems:
        if len(checker.problems) == 1:
            raise ConfigError(checker.problems[0])
        lines = "\n".join(f"  - {problem}" for problem in checker.problems)
        raise ConfigError(f"{len(checker.problems)} problems in the config:\n{lines}")
    return args
