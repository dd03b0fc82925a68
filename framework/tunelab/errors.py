"""The small family of errors tunelab raises for a user's mistake.

The CLI prints any ``TunelabError`` as one line and exits non-zero; every other exception
is a bug and keeps its traceback.
"""

import re


class TunelabError(Exception):
    """A user-facing error: bad input, a missing file, an invalid config."""


class ConfigError(TunelabError, ValueError):
    """A config file or override is malformed or does not validate."""


class CheckpointError(TunelabError):
    """A checkpoint is missing, corrupt, incomplete, or does not match the config."""


class DataError(TunelabError, ValueError):
    """A dataset file or row is malformed."""


class TrainingError(TunelabError):
    """Training cannot go on meaningfully: a non-finite loss or gradient, say."""


def first_line(error: BaseException) -> str:
    """Return the first non-empty line of an error's message ("" when it has none).

    Libraries append detail lines to their messages (OmegaConf adds ``full_key: ...`` and
    ``object_type=...``, DCP a traceback per rank); a one-line error keeps the line that says
    what went wrong.
    """
    return next(iter(str(error).strip().splitlines()), "")


MAX_LINE_CHARS = 200
"""The length an error line is shortened towards (``shorten``)."""

# A path: at least one `/` between name characters (`outputs/run/step_3`, `/tmp/x.jsonl`).
_PATH_RE = re.compile(r"[\w.~@+-]*(?:/[\w.~@+=,#-]+)+/?")
_ELLIPSIS = "..."
# A path up to this long is whole: its head says where, its tail names the file.
_LONG_PATH_CHARS = 100
# A printed mapping or list longer than this keeps only its start (`{'rank': 8, 'alpha'...}`).
_LONG_VALUE_CHARS = 24
# A line still longer than this after the elisions loses its middle, whatever it holds.
_HARD_LIMIT_CHARS = 2 * MAX_LINE_CHARS
_CUT = " ... "


def _values(line: str) -> list[str]:
    """The outermost printed values of a line: ``{...}``, ``[...]`` and ``Name(...)`` spans."""
    spans: list[str] = []
    closers: list[str] = []
    start, quote = 0, ""
    for index, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif closers and char in "'\"":
            quote = char
        elif char in "{[" or (char == "(" and (closers or line[index - 1 : index].isalnum())):
            start = index if not closers else start
            closers.append({"{": "}", "[": "]", "(": ")"}[char])
        elif closers and char == closers[-1]:
            closers.pop()
            if not closers:
                spans.append(line[start : index + 1])
    return spans


def _shorten_line(line: str, limit: int) -> str:
    # Printed values first: their start (the first keys) says most; then long paths, each
    # elided in the middle, so the root and the file name stay readable.
    for value in sorted(set(_values(line)), key=len, reverse=True):
        if len(line) <= limit or len(value) <= _LONG_VALUE_CHARS:
            break
        line = line.replace(value, f"{value[: _LONG_VALUE_CHARS - 4]}{_ELLIPSIS}{value[-1]}")
    for path in sorted(set(_PATH_RE.findall(line)), key=len, reverse=True):
        excess = len(line) - limit
        if excess <= 0 or len(path) <= _LONG_PATH_CHARS:
            break
        keep = max(_LONG_PATH_CHARS, len(path) - excess) - len(_ELLIPSIS)
        head = keep // 3
        line = line.replace(path, f"{path[:head]}{_ELLIPSIS}{path[len(path) - (keep - head) :]}")
    if len(line) > _HARD_LIMIT_CHARS:
        # The start says what failed and the end what to do: cut the middle.
        keep = _HARD_LIMIT_CHARS - len(_CUT)
        line = f"{line[: keep // 2]}{_CUT}{line[len(line) - (keep - keep // 2) :]}"
    return line


def shorten(message: str, limit: int = MAX_LINE_CHARS) -> str:
    """Shorten each line of an error message towards ``limit`` characters.

    A line over ``limit`` first loses the middle of long printed values (``{...}``,
    ``[...]``: their start stays), then of long paths (``/data/proj...run/step_152``: the root
    and the file name stay), until it fits; a path of 100 characters or less stays whole, as
    the file it names may be the whole message. A line still over twice ``limit`` loses its
    middle (`` ... ``), keeping what failed and what to do.

    Args:
        message: The message, one or more lines.
        limit: The length to shorten each line towards.

    Returns:
        The message, each line shortened.
    """
    return "\n".join(_shorten_line(line, limit) for line in message.split("\n"))
