"""What values a setting allows, declared on its type with ``Annotated``.

A recipe setting or a component argument carries its rules next to its type::

    batch_size: Annotated[int, Range(ge=1)] = 2
    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    output_dir: Annotated[str, NonEmpty(), OutputDir()]

Value constraints (``Range``, ``Finite``, ``NonEmpty``, ``OneOf``) take part in matching a value
to its type, so a value that breaks one is reported like a wrong type and names what is allowed:
``key 'batch_size': expected int >= 1, got 0``. Path checks (``ExistingPath``, ``OutputDir``,
``ModelDir``, ``TokenizerPath``) look at the file system once the value has its type and say what
is wrong with the path. ``parse_args``, ``validate``, ``tunelab validate`` and ``tunelab run``
all apply them, and the settings tables in the docs are generated from them.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tunelab._paths import suggest_path
from tunelab.config._model_dir import model_dir_problems


class Constraint:
    """A rule a value must follow, attached to a type with ``Annotated[T, constraint]``."""

    #: Whether ``describe()`` reads before the type name ("finite float") or after ("int >= 1").
    before_type = False

    def describe(self) -> str:
        """Return what the rule allows, as a short phrase (``>= 1``, ``finite``)."""
        raise NotImplementedError

    def allows(self, value: Any) -> bool:
        """Return whether ``value`` (already of the field's type) follows the rule."""
        raise NotImplementedError

    def hint(self, value: Any) -> str:
        """Return extra advice for a value the rule refuses (e.g. a close match), or ''."""
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r})"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _format_bound(bound: float) -> str:
    return repr(bound) if isinstance(bound, float) and not bound.is_integer() else f"{bound:g}"


class Range(Constraint):
    """A number between bounds: ``ge``/``gt`` below, ``le``/``lt`` above (each optional).

    NaN is outside every range, since it compares false with any bound.

    Args:
        ge: The value must be >= this.
        gt: The value must be > this.
        le: The value must be <= this.
        lt: The value must be < this.

    Example::

        rank: Annotated[int, Range(ge=1)] = 8
        dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    """

    def __init__(
        self,
        *,
        ge: float | None = None,
        gt: float | None = None,
        le: float | None = None,
        lt: float | None = None,
    ) -> None:
        if ge is not None and gt is not None or le is not None and lt is not None:
            raise ValueError("Range takes at most one lower bound (ge/gt) and one upper (le/lt)")
        if ge is None and gt is None and le is None and lt is None:
            raise ValueError("Range needs a bound: ge, gt, le or lt")
        self.ge, self.gt, self.le, self.lt = ge, gt, le, lt

    def describe(self) -> str:  # noqa: D102
        low = self.ge if self.ge is not None else self.gt
        high = self.le if self.le is not None else self.lt
        if low is not None and high is not None:
            left = "[" if self.ge is not None else "("
            right = "]" if self.le is not None else ")"
            return f"in {left}{_format_bound(low)}, {_format_bound(high)}{right}"
        if low is not None:
            return f"{'>=' if self.ge is not None else '>'} {_format_bound(low)}"
        return f"{'<=' if self.le is not None else '<'} {_format_bound(high)}"

    def allows(self, value: Any) -> bool:  # noqa: D102
        if not _number(value):
            return False
        checks = (
            self.ge is None or value >= self.ge,
            self.gt is None or value > self.gt,
            self.le is None or value <= self.le,
            self.lt is None or value < self.lt,
        )
        return all(checks) and not (isinstance(value, float) and math.isnan(value))


class Finite(Constraint):
    """A number that is neither NaN nor infinite."""

    before_type = True

    def describe(self) -> str:  # noqa: D102
        return "finite"

    def allows(self, value: Any) -> bool:  # noqa: D102
        return _number(value) and math.isfinite(value)


class NonEmpty(Constraint):
    """A string with more than white space, or a list, tuple or mapping with an item."""

    before_type = True

    def describe(self) -> str:  # noqa: D102
        return "non-empty"

    def allows(self, value: Any) -> bool:  # noqa: D102
        if isinstance(value, str):
            return bool(value.strip())
        return len(value) > 0


class OneOf(Constraint):
    """One of a fixed set of values (compared with their types: ``True`` is not ``1``).

    Prefer ``Literal[...]`` for a dataclass field; ``OneOf`` suits component arguments whose
    builders take a plain ``str``.

    Args:
        *choices: The allowed values.
    """

    def __init__(self, *choices: Any) -> None:
        if not choices:
            raise ValueError("OneOf needs at least one choice")
        self.choices = tuple(choices)

    def describe(self) -> str:  # noqa: D102
        return "one of " + " | ".join(repr(choice) for choice in self.choices)

    def allows(self, value: Any) -> bool:  # noqa: D102
        return any(type(value) is type(choice) and value == choice for choice in self.choices)

    def hint(self, value: Any) -> str:  # noqa: D102
        names = [choice for choice in self.choices if isinstance(choice, str)]
        close = difflib.get_close_matches(str(value), names, n=1) if names else []
        return f"; did you mean {close[0]!r}?" if close else ""


# --- path checks -----------------------------------------------------------------------------


class PathCheck(Constraint):
    """A rule about what a path points at; checked after the value has its type.

    Subclasses implement ``problems``. A path check never refuses a value while its type is
    being matched (``allows`` is always true), so its own message reaches the user.
    """

    def allows(self, value: Any) -> bool:  # noqa: D102
        return True

    def problems(self, path: str) -> list[str]:
        """Return what is wrong with the path, one message per problem (empty when fine)."""
        raise NotImplementedError


def missing_path_message(what: str, path: str | os.PathLike) -> str:
    """Return ``"<what> not found: <path>"`` with a did-you-mean of a close existing path."""
    message = f"{what} not found: {path}"
    close = suggest_path(path)
    return message + (f"; did you mean '{close}'?" if close else "")


class ExistingPath(PathCheck):
    """A path that exists: a file, a folder (optionally holding given files) or either.

    Args:
        kind: ``"file"``, ``"dir"`` or ``"any"``.
        contains: For a folder, names of files it must hold.
    """

    def __init__(self, kind: str = "any", contains: Sequence[str] = ()) -> None:
        if kind not in ("file", "dir", "any"):
            raise ValueError(f"kind must be 'file', 'dir' or 'any', got {kind!r}")
        self.kind = kind
        self.contains = tuple(contains)

    def describe(self) -> str:  # noqa: D102
        noun = {"file": "existing file", "dir": "existing folder", "any": "existing path"}
        holding = f" holding {', '.join(self.contains)}" if self.contains else ""
        return noun[self.kind] + holding

    def problems(self, path: str) -> list[str]:  # noqa: D102
        target = Path(path).expanduser()
        noun = {"file": "file", "dir": "folder", "any": "path"}[self.kind]
        if not target.exists():
            return [missing_path_message(noun, path)]
        if self.kind == "file" and not target.is_file():
            return [f"{path} is not a file"]
        if self.kind == "dir" and not target.is_dir():
            return [f"{path} is a file, expected a folder"]
        missing = [name for name in self.contains if not (target / name).is_file()]
        if missing:
            return [f"{path} has no {', '.join(missing)}"]
        return []


def writable_dir_problem(path: str | os.PathLike) -> str | None:
    """Return why a folder cannot be used (or created) for output, or None if it can.

    The folder may be missing: its nearest existing ancestor must then be a writable folder.

    Args:
        path: The folder.

    Returns:
        A message naming the path that is in the way, or None.
    """
    target = Path(path).expanduser()
    if target.exists():
        if not target.is_dir():
            return f"{path} is a file, expected a folder"
        if not os.access(target, os.W_OK | os.X_OK):
            return f"{path} is not writable"
        return None
    ancestor = target.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot create {path}: {ancestor} is a file"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot create {path}: {ancestor} is not writable"
    return None


class OutputDir(PathCheck):
    """A folder to write to: an existing writable folder, or one that can be created."""

    def describe(self) -> str:  # noqa: D102
        return "writable folder (created if missing)"

    def problems(self, path: str) -> list[str]:  # noqa: D102
        problem = writable_dir_problem(path)
        return [problem] if problem else []


class ModelDir(PathCheck):
    """A Hugging Face model folder tunelab can load.

    It must hold ``config.json`` naming a supported ``model_type``, safetensors weights (every
    file a ``model.safetensors.index.json`` names) and a ``tokenizer.json`` whose ids all fit
    ``vocab_size``, with the special tokens its config files name. A missing folder gets a
    ``tunelab download`` hint.
    """

    def describe(self) -> str:  # noqa: D102
        return "Hugging Face model folder: config.json, *.safetensors, tokenizer.json"

    def problems(self, path: str) -> list[str]:  # noqa: D102
        return model_dir_problems(path)


class TokenizerPath(PathCheck):
    """A folder holding ``tokenizer.json``, or the path of a ``tokenizer.json`` file."""

    def describe(self) -> str:  # noqa: D102
        return "folder holding tokenizer.json, or a tokenizer.json file"

    def problems(self, path: str) -> list[str]:  # noqa: D102
        target = Path(path).expanduser()
        if not target.exists():
            return [missing_path_message("tokenizer folder", path)]
        if target.is_dir() and not (target / "tokenizer.json").is_file():
            return [f"{path} has no tokenizer.json"]
        return []
