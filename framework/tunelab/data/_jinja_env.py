"""The sandboxed Jinja environment chat templates render in, as ``transformers`` builds it.

``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks`` and the
``loopcontrols`` extension; the helpers templates call (``raise_exception``, ``strftime_now``,
a ``tojson`` filter that keeps non-ASCII text and key order); a ``namespace()`` without
underscore attributes and a ``dict`` that is not the ``dict`` type, so a template from a model
folder cannot reach Python internals; and the ``{% generation %}`` extension, which records the
character span of each block while a render is tracked.
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
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


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
        super().__setitem__(name, value)


class _Dict:
    """The ``dict`` global: builds dicts, but is not the ``dict`` type a template could dig into."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:  # noqa: D102
        return dict.fromkeys(*args, **kwargs)


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
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
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
