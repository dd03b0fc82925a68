"""The parts of lm-evaluation-harness tunelab uses, imported in one place.

``lm-eval`` is an optional dependency (``pip install 'tunelab[eval]'``); without it, importing
``tunelab.eval`` is one error that says how to install it.
"""

from tunelab.errors import ConfigError

try:
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
    "TemplateLM",
    "get_rolling_token_windows",
    "handle_stop_sequences",
    "make_disjoint_window",
    "normalize_gen_kwargs",
    "postprocess_generated_text",
]
