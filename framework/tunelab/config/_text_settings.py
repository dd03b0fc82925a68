"""Which settings a command-line override sets as text, taken literally rather than as YAML.

``output_dir="runs/exp #3"`` reaches the recipe as ``output_dir=runs/exp #3`` (the shell drops
the quotes), and YAML would read ``#3`` as a comment, ``a: b`` as a mapping, ``{x}`` as a flow
mapping, ``- x`` as a list and a newline as a space. When the recipe's settings say the key is
text (``str``, ``Path``, or a ``Literal`` of strings, optionally ``| None``), the value is that
text, exactly as typed. The key is followed through nested settings dataclasses and into the
arguments of a built-in component (``tokenizer.path``, ``metric_loggers.0.log_dir``), whose
types come from ``_component_rules``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tunelab.config._args import component_spec
from tunelab.config._component_rules import RULES
from tunelab.config._instantiate import COMPONENT_KEY
from tunelab.config._static import StaticCallable, resolve_static
from tunelab.config._types import split_annotated

_NONE = type(None)
# What YAML reads as null; for an optional text setting these still mean None.
NULL_WORDS = frozenset({"null", "Null", "NULL", "~"})


def _arms(hint: Any) -> tuple[Any, ...]:
    hint = split_annotated(hint)[0]
    if typing.get_origin(hint) in (Union, types.UnionType):
        return tuple(split_annotated(arm)[0] for arm in typing.get_args(hint))
    return (hint,)


def is_text(hint: Any) -> bool:
    """Whether a settings type holds only text: ``str``, ``Path``, string ``Literal`` (or ``| None``)."""
    arms = [arm for arm in _arms(hint) if arm is not _NONE]
    if not arms:
        return False
    for arm in arms:
        if typing.get_origin(arm) is Literal:
            if not all(isinstance(choice, str) for choice in typing.get_args(arm)):
                return False
        elif arm not in (str, Path):
            return False
    return True


def is_optional(hint: Any) -> bool:
    """Whether a settings type allows None."""
    return _NONE in _arms(hint)


def _dataclass_of(hint: Any) -> type | None:
    for arm in _arms(hint):
        if isinstance(arm, type) and dataclasses.is_dataclass(arm):
            return arm
    return None


def _component_argument_hint(node: Any, argument: str) -> Any | None:
    """The rule type of one argument of a built-in component node, or None if unknown."""
    if not isinstance(node, DictConfig):
        return None
    try:
        dotted = node.get(COMPONENT_KEY)
    except OmegaConfBaseException:
        return None
    if not isinstance(dotted, str):
        return None
    found = resolve_static(dotted)  # From the source only: nothing is imported here.
    rules = RULES.get(found.name) if isinstance(found, StaticCallable) else None
    return rules.args.get(argument) if rules is not None else None


def setting_type(args_cls: type, cfg: DictConfig, key: str) -> Any | None:
    """Return the declared type of the setting a dotted key names, or None if it is unknown.

    Args:
        args_cls: The recipe's settings dataclass.
        cfg: The config as it stands (earlier overrides applied): a component argument's type
            depends on the ``_component_`` the config names.
        key: The override's key, e.g. ``output_dir``, ``checkpoint.resume_from_checkpoint``,
            ``tokenizer.path`` or ``metric_loggers.0.log_dir``.

    Returns:
        The type annotation (with its ``Annotated`` constraints), or None when the key is not a
        declared setting (an unknown key, a component the rules do not cover, a list item).
    """
    parts = key.split(".")
    cls = args_cls
    for index, part in enumerate(parts):
        fields = {field.name: field for field in dataclasses.fields(cls) if field.init}
        field = fields.get(part)
        if field is None:
            return None
        hint = typing.get_type_hints(cls, include_extras=True)[part]
        rest = parts[index + 1 :]
        if not rest:
            return hint
        if component_spec(field) is not None:
            try:
                node = OmegaConf.select(cfg, ".".join(parts[: index + 1]), throw_on_missing=False)
            except OmegaConfBaseException:
                return None
            if isinstance(node, ListConfig):
                if not rest[0].isdigit() or int(rest[0]) >= len(node):
                    return None
                node, rest = node[int(rest[0])], rest[1:]
            return _component_argument_hint(node, rest[0]) if len(rest) == 1 else None
        nested = _dataclass_of(hint)
        if nested is None:
            return None
        cls = nested
    return None
