"""The sandboxed Jinja environment chat templates render in, as ``transformers`` builds it.

``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks`` and the
``loopcontrols`` extension; the helpers templates call (``raise_exception``, ``strftime_now``,
a ``tojson`` filter that keeps non-ASCII text and key order); a ``namespace()`` without
underscore attributes and a ``dict`` that is not the ``dict`` type, so a template from a model
folder cannot reach Python internals; and the ``{% generation %}`` extension, which records the
character span of each block while a render is tracked.

Every hook of the sandbox (calls, filters, the ``*``, ``%`` and ``**`` operators, namespace
assignments) also holds the render to its budget of time and size (``_render_budget``), so a
template cannot exhaust the machine.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg

from tunelab.data import _render_budget
from tunelab.errors import DataError

_MIN_JINJA = (3, 1, 6)  # Older releases have known sandbox escapes.

# Output rendered so far and the generation spans found, while a render tracks them.
_TRACKING: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "tunelab_generation_tracking", default=None
)


class _GenerationBlocks(Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body and records where it went."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:  # noqa: D102
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_record", []), [], [], body).set_lineno(lineno)

    def _record(self, caller: Any) -> str:
        text = caller()
        state = _TRACKING.get()
        if state is not None:
            # The render is streamed: everything before this block has already been yielded.
            rendered, spans = state
            start = sum(map(len, rendered))
            spans.append((start, start + len(text)))
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and sorts keys; chat templates expect neither.
    encoder = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    entry = _render_budget.current()
    if entry is None:
        return encoder.encode(value)
    # Built piece by piece and measured as it grows: an indent makes the text far larger
    # than the value it describes.
    pieces, size = [], 0
    for piece in encoder.iterencode(value):
        size += len(piece)
        entry.check_size(size, "tojson output")
        pieces.append(piece)
    return "".join(pieces)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates may not set underscore attributes on a namespace ({name!r})"
        )


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` without underscore attributes, which could reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick: no `self`
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        entry = _render_budget.current()
        if entry is not None:  # A namespace carries values across loop iterations.
            entry.check_time()
            _render_budget.check_result(entry, value, "namespace assignment")
        super().__setitem__(name, value)


class _Dict:
    """The ``dict`` global: builds dicts, but is not the ``dict`` type a template could dig into."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:  # noqa: D102
        return dict.fromkeys(*args, **kwargs)


def _is_data_callable(obj: Any) -> bool:
    """Whether ``obj``'s arguments are data, not amounts, or are checked by ``obj`` itself.

    Building a dict allocates nothing beyond what it is given; ``str.format`` checks its widths.
    """
    if isinstance(obj, _Dict) or obj is _Namespace or hasattr(obj, "_tunelab_budgeted"):
        return True
    owner = getattr(obj, "__self__", None)
    return isinstance(owner, (dict, _Dict))  # dict.get(key, default) and the like


def _budgeted_filter(name: str, function: Any) -> Any:
    """``function`` as a filter held to the render budget (its value is data, not an amount)."""
    pass_arg = _PassArg.from_obj(function)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        entry = _render_budget.current()
        if entry is None:
            return function(*args, **kwargs)
        entry.check_time()
        value_at = 0 if pass_arg is None else 1  # after context/environment, when passed
        value, amounts = args[value_at] if len(args) > value_at else None, args[value_at + 1 :]
        what = f"the {name} filter"
        if isinstance(value, (list, tuple, dict)):  # a filter may print it (string, join)
            _render_budget.check_text(entry, [value], f"the value passed to {what}")
        if name == "format" and isinstance(value, str):
            _render_budget.check_percent_format(entry, value, tuple(amounts) or kwargs)
        else:
            _render_budget.check_amounts(entry, [*amounts, *kwargs.values()], what)
            _render_budget.check_amplifier(entry, name, value, amounts, kwargs)
        return _render_budget.check_result(entry, function(*args, **kwargs), what)

    return wrapper


class _BudgetedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with ``a ~ b`` measured before its text is made."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:  # noqa: D102
        self.write("environment.budgeted_concat((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")


def _budgeted_output(value: Any) -> Any:
    """``finalize``: what ``{{ value }}`` prints is measured before it becomes text."""
    if not isinstance(value, str):
        entry = _render_budget.current()
        if entry is not None:
            _render_budget.check_text(entry, [value], "a printed value")
    return value


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every hook holding the render to its budget."""

    code_generator_class = _BudgetedCodeGenerator

    def budgeted_concat(self, values: tuple[Any, ...]) -> str:
        """``a ~ b ~ ...`` (jinja's ``str_join``), measured first."""
        entry = _render_budget.current()
        if entry is not None:
            entry.check_time()
            _render_budget.check_text(entry, values, "a concatenation")
        return "".join(map(str, values))

    # `+` and `~` at most double a value, and a doubled value is checked where it is kept
    # (a namespace, a call's arguments, the output); these three multiply it.
    intercepted_binops = frozenset(("*", "%", "**"))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        """Call ``__obj`` from the template, within the render budget."""
        entry = _render_budget.current()
        if entry is None:
            return super().call(__context, __obj, *args, **kwargs)
        entry.check_time()
        if not _is_data_callable(__obj):
            _render_budget.check_amounts(entry, [*args, *kwargs.values()], repr_name(__obj))
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                name = getattr(__obj, "__name__", "")
                _render_budget.check_amplifier(entry, name, owner, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return _render_budget.check_result(entry, result, repr_name(__obj))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """Apply ``operator`` after checking its result's size."""
        entry = _render_budget.current()
        if entry is not None:
            _render_budget.check_binop(entry, operator, left, right)
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any) -> Any:
        """``str.format``/``format_map``, sandboxed by jinja, with its widths checked first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        template, is_map = value.__self__, value.__name__ == "format_map"

        @functools.wraps(wrapped)
        def wrapper(*args: Any, **kwargs: Any) -> str:
            entry = _render_budget.current()
            if entry is not None:
                if is_map and len(args) == 1 and isinstance(args[0], dict):
                    args, kwargs = (), args[0]
                _render_budget.check_str_format(entry, template, args, kwargs)
            return wrapped(*args, **kwargs)

        wrapper._tunelab_budgeted = True  # type: ignore[attr-defined]
        return wrapper


def repr_name(obj: Any) -> str:
    """A short name of a callable for budget messages."""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    return f"{name}()" if name else type(obj).__name__


@functools.lru_cache(maxsize=1)
def environment() -> ImmutableSandboxedEnvironment:
    """The one environment all chat templates compile in.

    Raises:
        DataError: If jinja2 is older than 3.1.6.
    """
    version = tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < _MIN_JINJA:
        raise DataError(
            f"chat templates need jinja2>=3.1.6 (older releases have sandbox escapes); "
            f"found {jinja2.__version__}: pip install -U jinja2"
        )
    environment = _BudgetedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlocks, loopcontrols],
        # No constant folding: it would run a template's constant expressions (a
        # `'%0999999999d'|format(1)`) while compiling, outside any render budget.
        optimized=False,
        finalize=_budgeted_output,
    )
    environment.filters["tojson"] = _tojson
    environment.filters = {
        name: _budgeted_filter(name, function) for name, function in environment.filters.items()
    }
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _Dict()
    environment.globals["namespace"] = _Namespace
    return environment


def template_line(error: BaseException) -> int | None:
    """The template line an error was raised on (jinja rewrites tracebacks to template lines)."""
    line = getattr(error, "lineno", None)
    traceback = error.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == "<template>":
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    return line


@contextmanager
def tracking(rendered: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
    """Record generation-block spans into ``spans`` while the render appends to ``rendered``."""
    token = _TRACKING.set((rendered, spans))
    try:
        yield
    finally:
        _TRACKING.reset(token)


@contextmanager
def no_tracking() -> Iterator[None]:
    """Record nothing: a render inside a tracked one must not write into the outer spans."""
    token = _TRACKING.set(None)
    try:
        yield
    finally:
        _TRACKING.reset(token)
