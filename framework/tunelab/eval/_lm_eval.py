"""The parts of lm-evaluation-harness tunelab uses, imported in one place.

``lm-eval`` is an optional dependency (``pip install 'tunelab[eval]'``); without it, importing
``tunelab.eval`` is one error that says how to install it.
"""

import contextlib
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
    "quiet",
    "TemplateLM",
    "get_rolling_token_windows",
    "handle_stop_sequences",
    "make_disjoint_window",
    "normalize_gen_kwargs",
    "postprocess_generated_text",
]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Run lm-eval without its console output: progress bars and git's complaint.

    lm-eval draws a progress bar per task and rank while it builds the requests (and one while
    it tokenizes them), and its results record asks ``git describe``, which prints ``fatal: not
    a git repository`` from any other folder. Between training steps they would break up the
    training progress bar at every evaluation; nothing in them is needed there (the scores
    are logged). The bars' ``tqdm`` of lm-eval's own modules is swapped for a disabled one and
    the git hash for None while the block runs.
    """
    from tqdm import tqdm

    def silent(*args: Any, **kwargs: Any) -> tqdm:
        return tqdm(*args, **{**kwargs, "disable": True})

    saved = (_task_module.tqdm, _model_module.tqdm, _evaluator_module.get_git_commit_hash)
    _task_module.tqdm = _model_module.tqdm = silent
    _evaluator_module.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        _task_module.tqdm, _model_module.tqdm, _evaluator_module.get_git_commit_hash = saved
