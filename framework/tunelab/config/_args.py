"""Typed recipe settings: a dataclass per recipe, one documented field per setting."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, TypeAlias

from omegaconf import DictConfig

Component: TypeAlias = DictConfig
"""The type of a component field: the ``_component_`` node, built later with ``instantiate``."""

_COMPONENT_META = "tunelab_component"


@dataclass(frozen=True)
class ComponentSpec:
    """How a component field is checked.

    Attributes:
        required: Whether the node must be present (not null).
        call_args: Keyword names the recipe passes at the call site (e.g. ``params`` for an
            optimizer); the config must not set them and they count as given when binding.
        called_later: The node names a callable called with arguments the config cannot
            know (an agentic tool is called with the model's arguments): its required
            arguments are not required of the config (its keys are still checked).
    """

    required: bool = True
    call_args: tuple[str, ...] = ()
    called_later: bool = False


def component(
    required: bool = True,
    call_args: tuple[str, ...] = (),
    default: str | None = None,
    called_later: bool = False,
) -> Any:
    """Declare a field whose YAML value is a ``_component_`` node (or a list of them).

    Annotate the field ``Component``, ``Component | None`` or ``list[Component]``. A required
    field has no default; an optional one defaults to ``None`` (``parse_args`` turns a missing
    or null list into ``[]``). A field with a ``default`` component may be left out of the
    config (then it is ``{_component_: default}``) but not set to null.

    Args:
        required: Whether the config must give the component (with ``default``: not null).
        call_args: Keyword names the recipe supplies when it calls ``instantiate``.
        default: Dotted path of the component used when the config leaves the field out.
        called_later: See :class:`ComponentSpec`.

    Returns:
        A ``dataclasses.field`` carrying the component's spec.

    Example::

        optimizer: Component = component(call_args=("params",))
        \"\"\"The optimizer; the recipe passes ``params``.\"\"\"
    """
    metadata = {_COMPONENT_META: ComponentSpec(required, tuple(call_args), called_later)}
    if default is not None:
        return dataclasses.field(
            default_factory=lambda: DictConfig({"_component_": default}), metadata=metadata
        )
    if required:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=None, metadata=metadata)


def component_spec(field: dataclasses.Field) -> ComponentSpec | None:
    """Return the spec of a component field, or None for any other field."""
    return field.metadata.get(_COMPONENT_META)


@dataclass(kw_only=True)
class RecipeArgs:
    """Base of every recipe's settings dataclass.

    Subclass it with ``@dataclass(kw_only=True)``, give every field a type, a default where
    one makes sense, and a one-line docstring (a string literal right under the field).
    """

    recipe: str
    """The recipe this config belongs to: a built-in recipe name or a path to a ``.py`` file."""

    def check_settings(self) -> list[str]:
        """Return the problems that involve several settings, one message per problem.

        ``parse_args`` and ``validate`` call it once every setting is valid on its own, and
        report what it returns with the rest. Override it for a rule across settings (and
        extend ``super().check_settings()``); each message should name the key it is about.
        """
        return []


def _class_field_docs(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(source)
    class_def = next(node for node in tree.body if isinstance(node, ast.ClassDef))
    docs = {}
    body = class_def.body
    for statement, following in zip(body, body[1:]):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """Return the attribute docstring of every documented field of a dataclass.

    The docstring of a field is the string literal right under it in the class body
    (the convention of PEP 257 attribute docstrings); fields inherited from base classes are
    included. Fields without one are absent from the result.

    Args:
        cls: A dataclass.

    Returns:
        A mapping from field name to its docstring.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_class_field_docs(klass))
    names = {field.name for field in dataclasses.fields(cls)}
    return {name: doc for name, doc in docs.items() if name in names}
