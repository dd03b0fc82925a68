"""A chat template render's budget: a deadline and a size limit, so no template exhausts a machine.

A template from a model folder is untrusted code. The sandbox keeps it from Python's internals,
but not from work: nested loops, ``lipsum(10**6)``, ``tojson(indent=10**9)``, a format width of
a billion, ``'a' * 10**9``. Each render therefore runs under a budget:

* **time**: ``RENDER_SECONDS`` per render. The sandbox's hooks (every call, filter,
  intercepted operator, namespace assignment) check the deadline; a loop with none of those in its
  body (``{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}``) or a
  long pure-Python helper is stopped by a watchdog thread, which raises ``RenderBudgetExceeded``
  in the rendering thread at its next bytecode (``PyThreadState_SetAsyncExc``).
* **size**: ``max_chars = RENDER_BASE_CHARS + RENDER_INPUT_FACTOR * input characters``. The
  output, every value a call, filter, operator or namespace assignment produces, and every
  length, width, indent or count passed to one are held to it; amounts that decide an
  allocation before it happens (``*`` repetition, ``%``/``format`` widths, ``**``, ``replace``,
  ``join``, ``tojson`` output) are checked before the allocation.

A render that exceeds either stops with ``RenderBudgetExceeded``; the chat template turns it
into one ``RenderBudgetError`` line naming the template, which ends a dataset build at the
first overrun (the template is at fault, not the row).
"""

from __future__ import annotations

import ctypes
import os
import re
import string
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

RENDER_SECONDS = 3.0
"""Wall time one render may take (a real chat template renders in well under a millisecond)."""
RENDER_BASE_CHARS = 1 << 20
"""Characters any render may produce, whatever its input."""
RENDER_INPUT_FACTOR = 8
"""A render may also produce this many characters per character of its input."""
MAX_INT_BITS = 1 << 20
"""Bits of an integer an operator may produce (``9**9**9`` is refused before it is computed)."""
_WATCH_INTERVAL_S = 0.05
# The hooks read the clock on every this-many-th call (the watchdog covers the time between).
_CLOCK_EVERY = 16
# The watchdog raises again in a render that ignored (swallowed) its first stop.
_RESTOP_INTERVAL_S = 1.0


class RenderBudgetExceeded(BaseException):  # noqa: N818 - it is a stop, not a bug
    """A render ran out of time or size. A ``BaseException``: a template cannot catch it.

    ``except Exception`` in jinja's or Python's helpers must not swallow the stop the watchdog
    raises into them.
    """


@dataclass(eq=False)
class Budget:
    """The limits of one render in progress.

    Attributes:
        deadline: ``time.monotonic()`` value past which the render stops.
        seconds: The time limit, for messages.
        inputs: The render's input (its variables), measured only when a size passes
            ``RENDER_BASE_CHARS`` (most renders never need the measure).
        thread_id: The rendering thread (``threading.get_ident()``).
        stopped_at: When the watchdog raised into the thread, 0 while it has not.
    """

    deadline: float
    seconds: float
    inputs: Any = None
    thread_id: int = field(default_factory=threading.get_ident)
    stopped_at: float = 0.0
    ticks: int = 0
    _max_chars: int | None = None

    @property
    def max_chars(self) -> int:
        """The largest output, value, width or count the render may produce or use."""
        if self._max_chars is None:
            self._max_chars = RENDER_BASE_CHARS + RENDER_INPUT_FACTOR * input_chars(self.inputs)
        return self._max_chars

    def check_time(self) -> None:
        """Raise ``RenderBudgetExceeded`` once the deadline has passed (read every few calls)."""
        self.ticks += 1
        if self.ticks % _CLOCK_EVERY == 1 and time.monotonic() > self.deadline:
            raise RenderBudgetExceeded(self.timeout_message())

    def timeout_message(self) -> str:
        """What to say when the time is up."""
        return f"rendering took longer than {self.seconds:g} s (the render budget)"

    def check_size(self, size: int, what: str) -> None:
        """Raise ``RenderBudgetExceeded`` when ``size`` is over ``max_chars``."""
        if size > RENDER_BASE_CHARS and size > self.max_chars:
            raise RenderBudgetExceeded(
                f"{what} of {size} exceeds the render budget of {self.max_chars} characters"
            )


_CURRENT: ContextVar[Budget | None] = ContextVar("tunelab_render_budget", default=None)


def current() -> Budget | None:
    """The budget of the render running in this context, or None outside a render."""
    return _CURRENT.get()


def input_chars(value: Any, limit: int = 1 << 34) -> int:
    """Characters in a render's input (strings in nested lists and dicts, keys included)."""
    total, stack = 0, [value]
    while stack and total < limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (dict, Mapping)):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            total += 8
    return total


@contextmanager
def budget(inputs: Any, seconds: float | None = None) -> Iterator[Budget]:
    """Run a render under a budget (see the module docstring); renders may nest.

    Args:
        inputs: The render's input (strings, nested in lists and dicts): the size limit
            grows with its characters (``input_chars``).
        seconds: The time limit; ``RENDER_SECONDS`` when None.

    Yields:
        The budget in force.

    Raises:
        RenderBudgetExceeded: If the render ran out of time or size.
    """
    seconds = RENDER_SECONDS if seconds is None else seconds
    outer = _CURRENT.get()
    if outer is not None:  # A nested render shares the outer one's limits.
        entry = outer
    else:
        entry = Budget(deadline=time.monotonic() + seconds, seconds=seconds, inputs=inputs)
    token = _CURRENT.set(entry)
    if outer is None:
        _WATCHDOG.watch(entry)
    try:
        yield entry
    finally:
        _CURRENT.reset(token)
        if outer is None:
            _WATCHDOG.unwatch(entry)


def _set_async_exc(thread_id: int, exception: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exception) if exception else None
    )


class _Watchdog:
    """One daemon thread per process that stops renders past their deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: set[Budget] = set()
        self._pid = -1
        self._wake = threading.Event()

    def watch(self, entry: Budget) -> None:
        with self._lock:
            if self._pid != os.getpid():  # First use, or a forked child without the thread.
                self._pid = os.getpid()
                self._wake = threading.Event()
                threading.Thread(
                    target=self._run, args=(self._wake,), name="tunelab-render-watchdog",
                    daemon=True,
                ).start()  # fmt: skip
            self._watched.add(entry)
            self._wake.set()

    def unwatch(self, entry: Budget) -> None:
        with self._lock:
            self._watched.discard(entry)
            if entry.stopped_at:
                # The render ended on its own after the stop was sent: cancel it if pending.
                _set_async_exc(entry.thread_id, None)

    def _run(self, wake: threading.Event) -> None:
        while True:
            wake.wait()
            time.sleep(_WATCH_INTERVAL_S)
            now = time.monotonic()
            with self._lock:
                if not self._watched:
                    wake.clear()
                for entry in self._watched:
                    if now > entry.deadline and now - entry.stopped_at > _RESTOP_INTERVAL_S:
                        entry.stopped_at = now
                        _set_async_exc(entry.thread_id, RenderBudgetExceeded)


_WATCHDOG = _Watchdog()


# ---- checks the sandbox runs ------------------------------------------------------------
def text_size(value: Any, limit: int) -> int:
    """A lower bound of ``len(str(value))``, counted only until it passes ``limit``.

    A list that holds one large list 100000 times is small to build and gigantic to print:
    this walks the value (stopping once the count passes ``limit``, so shared references cost
    nothing more) and measures the text it would become before any of it is made.
    """
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, bool) or item is None:
            total += 4
        elif isinstance(item, int):
            total += max(1, item.bit_length() * 3 // 10)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * max(len(item) - 1, 0)
            stack.extend(item)
        elif isinstance(item, (dict, Mapping)):
            total += 2 + 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        else:
            total += 1
    return total


def check_text(entry: Budget, values: Any, what: str) -> None:
    """Check the text ``values`` become (each printed or joined) before it is made."""
    limit = entry.max_chars
    total = 0
    for value in values:
        total += len(value) if isinstance(value, str) else text_size(value, limit - total)
        entry.check_size(total, what)


def _size(value: Any) -> int | None:
    if isinstance(value, str):  # the common case first: most values are text
        return len(value)
    if value is None or isinstance(value, int | float):
        return None
    if isinstance(value, (bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    return None


def check_result(entry: Budget, value: Any, what: str) -> Any:
    """Check a value a call, filter or operator produced; return it."""
    size = _size(value)
    if size is not None:
        entry.check_size(size, f"a {what} result")
    elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise RenderBudgetExceeded(f"a {what} produced an integer of {value.bit_length()} bits")
    return value


def check_amounts(entry: Budget, values: Any, what: str) -> None:
    """Check the integers (widths, counts, indents) and sizes of a call's arguments."""
    for value in values:
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            entry.check_size(abs(value), f"the amount {value} passed to {what}")
        else:
            size = _size(value)
            if size is not None:
                entry.check_size(size, f"an argument passed to {what}")


# %-format specs: mapping key, flags, width, precision, length modifier, conversion.
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")
_DIGITS = re.compile(r"\d+")


def check_percent_format(entry: Budget, template: str, args: Any) -> None:
    """Check the widths of ``template % args`` (``'%0999999999d'``, ``'%*d'``) before it runs."""
    starred = False
    for width, precision, _ in _PERCENT_SPEC.findall(template):
        for amount in (width, precision):
            if amount == "*":
                starred = True
            elif amount:
                entry.check_size(int(amount), "a format width")
    values = args if isinstance(args, tuple) else (args,)
    if starred:  # A `*` takes its width from the arguments.
        check_amounts(entry, [v for v in values if isinstance(v, int)], "a format width")
    check_text(entry, [template, *values], "a formatted text")


def check_str_format(entry: Budget, template: str, args: Any, kwargs: Mapping) -> None:
    """Check the widths of ``template.format(*args, **kwargs)`` before it runs."""
    nested = False
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError:
        return  # str.format raises the same error itself.
    for _, _, spec, _ in fields:
        if not spec:
            continue
        nested = nested or "{" in spec
        for amount in _DIGITS.findall(spec):
            entry.check_size(int(amount), "a format width")
    if nested:  # `{:>{width}}` takes its width from the arguments.
        check_amounts(
            entry, [v for v in (*args, *kwargs.values()) if isinstance(v, int)], "a format width"
        )
    check_text(entry, [template, *args, *kwargs.values()], "a formatted text")


def check_binop(entry: Budget, operator: str, left: Any, right: Any) -> None:
    """Check an operator's result size before it is computed."""
    entry.check_time()
    if operator == "+":
        if isinstance(left, str) and isinstance(right, str):  # text joined: the common case
            entry.check_size(len(left) + len(right), "a concatenation")
            return
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            size = _size(sequence)
            if size is not None and isinstance(count, int) and not isinstance(count, bool):
                entry.check_size(size * max(count, 0), "a repetition")
                if count > 0 and not isinstance(sequence, str):  # as text, when printed
                    weight = text_size(sequence, entry.max_chars // count + 1)
                    entry.check_size(weight * count, "a repetition (as text)")
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise RenderBudgetExceeded("a product exceeds the render budget's integer size")
    elif operator == "+":
        left_size, right_size = _size(left), _size(right)
        if left_size is not None and right_size is not None:
            entry.check_size(left_size + right_size, "a concatenation")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if left.bit_length() * right > MAX_INT_BITS:
                raise RenderBudgetExceeded("a power exceeds the render budget's integer size")
    elif operator == "%" and isinstance(left, str):
        check_percent_format(entry, left, right)


def _argument(args: Any, kwargs: Mapping, position: int, name: str, default: Any = None) -> Any:
    return args[position] if len(args) > position else kwargs.get(name, default)


def check_amplifier(entry: Budget, name: str, value: Any, args: Any, kwargs: Mapping) -> None:
    """Check the result size of a call that multiplies one argument by another's length.

    ``s.replace(old, new)`` and the ``replace`` filter, ``sep.join(items)`` and the ``join``
    filter, ``s.translate(table)``, and the ``indent`` and ``wordwrap`` filters given a string
    to insert: small arguments, results of any size. Their sizes are computed first.

    Args:
        entry: The budget.
        name: The method or filter name.
        value: The string the method is bound to, or the filter's value.
        args: The other positional arguments.
        kwargs: The keyword arguments.
    """
    what = f"{name}()"
    if name == "replace" and isinstance(value, str):
        old, new = _argument(args, kwargs, 0, "old"), _argument(args, kwargs, 1, "new")
        count = _argument(args, kwargs, 2, "count")
        if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
            hits = len(value) + 1 if not old else value.count(old)
            if isinstance(count, int) and count >= 0:
                hits = min(hits, count)
            entry.check_size(len(value) + hits * (len(new) - len(old)), f"a {what} result")
    elif name == "join":
        # The method is bound to the separator; the filter takes it as its argument.
        separator, items = (value, _argument(args, kwargs, 0, "iterable"))
        if not isinstance(separator, str):
            separator, items = _argument(args, kwargs, 0, "d", ""), value
        if isinstance(separator, str) and isinstance(items, (list, tuple, dict, str, range)):
            size = max(len(items) - 1, 0) * len(separator)
            entry.check_size(size, f"a {what} result")
            for item in items:
                size += len(item) if isinstance(item, str) else text_size(item, entry.max_chars)
                entry.check_size(size, f"a {what} result")
    elif name == "translate" and isinstance(value, str):
        table = _argument(args, kwargs, 0, "table")
        if isinstance(table, Mapping):
            longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
            entry.check_size(len(value) * longest, f"a {what} result")
    elif name in ("indent", "wordwrap") and isinstance(value, str):
        insert = _argument(args, kwargs, 0, "width") if name == "indent" else None
        if name == "wordwrap":
            insert = _argument(args, kwargs, 2, "wrapstring")
        if isinstance(insert, str):
            entry.check_size(len(value) + (len(value) + 1) * len(insert), f"a {what} result")
