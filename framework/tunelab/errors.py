"""The small family of errors tunelab raises for a user's mistake.

The CLI prints any ``TunelabError`` as one line and exits non-zero; every other exception
is a bug and keeps its traceback.
"""


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
