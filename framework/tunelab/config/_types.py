"""Check a config value against a field's type annotation."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

_NONE = type(None)


class TypeMismatch(Exception):
    """A value does not match a type; the message says what was expected and what came."""


def type_name(hint: Any) -> str:
    """Return a readable name for a type annotation (``int``, ``list[str]``, ``float | None``)."""
    if hint is _NONE:
        return "None"
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(choice) for choice in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(hint))
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in typing.get_args(hint))
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(hint, "__name__", str(hint))


def _describe(value: Any) -> str:
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"{type(value).__name__} {shown}"


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
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and _NONE in args:
            return None
        for arg in args:
            if arg is _NONE:
                continue
            try:
                return coerce(value, arg)
            except TypeMismatch:
                pass
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
