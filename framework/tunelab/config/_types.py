"""Check a config value against a field's type annotation and its ``Annotated`` constraints."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from tunelab.config.constraints import Constraint, PathCheck

_NONE = type(None)


class TypeMismatch(Exception):
    """A value does not match a type; the message says what was expected and what came.

    Attributes:
        refused: True when the value has the right type but a constraint refuses it.
    """

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def split_annotated(hint: Any) -> tuple[Any, tuple[Constraint, ...]]:
    """Return ``(type, constraints)`` of ``Annotated[type, *constraints]``; other hints pass."""
    if typing.get_origin(hint) is Annotated:
        inner, *extras = typing.get_args(hint)
        return inner, tuple(extra for extra in extras if isinstance(extra, Constraint))
    return hint, ()


def type_name(hint: Any) -> str:
    """Return a readable name for a type annotation and its value constraints.

    ``int``, ``list[str]``, ``float | None``, ``int >= 1``, ``finite float > 0``.
    """
    if hint is _NONE:
        return "None"
    inner, constraints = split_annotated(hint)
    if constraints or inner is not hint:
        values = [c for c in constraints if not isinstance(c, PathCheck)]
        before = [c.describe() for c in values if c.before_type]
        after = [c.describe() for c in values if not c.before_type]
        if any(c.describe().startswith("one of ") for c in values):
            return " ".join([*before, *after])
        return " ".join([*before, type_name(inner), *after])
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(choice) for choice in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(hint))
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in typing.get_args(hint))
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(hint, "__name__", str(hint))


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown[:37] + "..." if len(shown) > 40 else shown


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {_shown(value)}"


def coerce(value: Any, hint: Any) -> Any:
    """Return ``value`` as type ``hint``, converting only where it loses nothing.

    An int is accepted for a float field (``1`` -> ``1.0``), a string for a ``Path``, a list
    for a tuple; a bool is never an int.

    Args:
        value: A plain value (the config already converted to Python containers).
        hint: The field's resolved type annotation.

    Returns:
        The value, converted where needed.

    Raises:
        TypeMismatch: If the value does not fit.
    """
    if hint is Any:
        return value
    inner, constraints = split_annotated(hint)
    if inner is not hint:
        try:
            converted = coerce(value, inner)
        except TypeMismatch as err:
            if typing.get_origin(inner) is None:  # Name the whole rule, not just "float".
                raise TypeMismatch(f"expected {type_name(hint)}, got {_describe(value)}") from err
            raise
        for constraint in constraints:
            if not constraint.allows(converted):
                # The type is right, so the value as written says what came.
                raise TypeMismatch(
                    f"expected {type_name(hint)}, got {_shown(value)}" + constraint.hint(value),
                    refused=True,
                )
        return converted
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and _NONE in args:
            return None
        refusal = ""
        for arg in args:
            if arg is _NONE:
                continue
            try:
                return coerce(value, arg)
            except TypeMismatch as err:
                if err.refused and not refusal:
                    refusal = str(err).partition(f"got {_shown(value)}")[2]
                    refusal = f"got {_shown(value)}{refusal}"
        if refusal:
            raise TypeMismatch(f"expected {type_name(hint)}, {refusal}", refused=True)
        raise TypeMismatch(f"expected {type_name(hint)}, got {_describe(value)}")
    if origin is Literal:
        # Compare types too: True == 1 must not satisfy Literal[1].
        if any(type(value) is type(choice) and value == choice for choice in args):
            return value
        raise TypeMismatch(f"expected one of {type_name(hint)}, got {_describe(value)}")
    if origin in (list, tuple, typing.Sequence, set):
        if not isinstance(value, (list, tuple)):
            raise TypeMismatch(f"expected {type_name(hint)}, got {_describe(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise TypeMismatch(f"expected {type_name(hint)}, got {_describe(value)}")
            return tuple(coerce(item, arg) for item, arg in zip(value, args))
        item_hint = args[0] if args else Any
        items = [coerce(item, item_hint) for item in value]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeMismatch(f"expected {type_name(hint)}, got {_describe(value)}")
        key_hint, value_hint = args or (Any, Any)
        return {coerce(k, key_hint): coerce(v, value_hint) for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is Path and isinstance(value, str):
        return Path(value)
    if hint is int and isinstance(value, bool):
        raise TypeMismatch(f"expected int, got {_describe(value)}")
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    raise TypeMismatch(f"expected {type_name(hint)}, got {_describe(value)}")
