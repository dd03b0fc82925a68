"""The parts of lm-evaluation-harness tunelab uses, imported in one place.

``lm-eval`` is an optional dependency (``pip install 'tunelab[eval]'``); without it, importing
``tunelab.eval`` is one error that says how to install it.
"""

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from tunelab.errors import ConfigError

try:
    import lm_eval.api.model as _model_module
    import lm_eval.api.task as _task_module
    import lm_eval.evaluator as _evaluator_module
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import (
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as error:  # pragma: no cover - the dev install has it
    raise ConfigError(
        f"evaluation needs EleutherAI's lm-evaluation-harness ({error.name or error}): "
        "pip install 'tunelab[eval]'"
    ) from None

__all__ = [
    "Instance",
    "no_stray_output",
    "quiet",
    "TemplateLM",
    "get_rolling_token_windows",
    "handle_stop_sequences",
    "make_disjoint_window",
    "normalize_gen_kwargs",
    "postprocess_generated_text",
]


@contextlib.contextmanager
def no_stray_output() -> Iterator[None]:
    """Run lm-eval without the output of what it calls: git's complaint and ``datasets``' bars.

    lm-eval's results record asks ``git describe`` for the working directory's commit, which
    prints ``fatal: not a git repository`` from any other folder (git's own stderr, not
    lm-eval's); the hash is still recorded where there is one (git's stderr goes nowhere
    instead). ``datasets`` draws a ``Generating test split`` bar for every task it prepares.
    Neither says anything to act on. lm-eval's own progress bars are left as they are.
    """
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    saved = _evaluator_module.get_git_commit_hash
    _evaluator_module.get_git_commit_hash = _git_commit_hash
    try:
        yield
    finally:
        _evaluator_module.get_git_commit_hash = saved
        if bars:
            datasets.enable_progress_bars()


def _git_commit_hash() -> str | None:
    """lm-eval's ``get_git_commit_hash`` with git's stderr discarded."""
    import subprocess

    from lm_eval.loggers.utils import get_commit_from_path

    try:
        done = subprocess.run(
            ["git", "describe", "--always"],  # noqa: S607 - what lm-eval runs
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is not None and done.returncode == 0:
        return done.stdout.strip()
    return get_commit_from_path(os.getcwd())  # lm-eval's fallback: the .git files, if any


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Run lm-eval without its console output: progress bars (and :func:`no_stray_output`).

    lm-eval draws a progress bar per task and rank while it builds the requests (and one while
    it tokenizes them). Between training steps they would break up the training progress bar
    at every evaluation; nothing in them is needed there (the scores are logged). The bars'
    ``tqdm`` of lm-eval's own modules is swapped for a disabled one while the block runs.
    """
    from tqdm import tqdm

    def silent(*args: Any, **kwargs: Any) -> tqdm:
        return tqdm(*args, **{**kwargs, "disable": True})

    saved = (_task_module.tqdm, _model_module.tqdm)
    _task_module.tqdm = _model_module.tqdm = silent
    try:
        with no_stray_output():
            yield
    finally:
        _task_module.tqdm, _model_module.tqdm = saved
