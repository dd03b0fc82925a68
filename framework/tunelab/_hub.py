"""Whether the Hugging Face Hub answers, asked once per process, with a short time limit.

A hub dataset (a training ``source``, or an lm-eval task's ``dataset_path``) is loaded with
``datasets``, which asks the hub first even for a dataset in the local cache; when the hub
cannot be reached, ``huggingface_hub`` retries each request five times with back-off
(1 + 2 + 4 + 8 + 8 s, a ``Retrying in ...`` line each): measured, 41 s before a training
dataset's error and 63 s before an lm-eval task's. Asking once, with a short limit, and
switching the hub libraries to their offline mode when there is no answer makes an uncached
dataset fail at once (one line, saying why) and a cached one load from the cache, as with
``HF_HUB_OFFLINE=1``. Used by ``tunelab.data.sources`` and ``tunelab.eval.tasks``.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 3.0
"""How long the hub may take to answer the one request that checks it."""

_unreachable: list[str | None] = []  # the answer of this process, once asked


def offline_unless_hub_answers(timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """Switch ``huggingface_hub`` and ``datasets`` to offline mode if the hub does not answer.

    One ``HEAD`` request to the hub's endpoint (``HF_ENDPOINT``, through the hub library's own
    HTTP client and its proxy settings), without retries; any HTTP answer counts as an answer.
    Asked once per process. Nothing is asked when offline mode is already on.

    Args:
        timeout_s: Seconds to wait for the answer.

    Returns:
        None if the hub answered (or offline mode was already on); otherwise why it is taken
        to be unreachable, for the error of a dataset that then cannot be loaded:
        ``https://huggingface.co cannot be reached (timed out, 3 s limit)``.
    """
    if _unreachable:
        return _unreachable[0]
    import datasets
    import huggingface_hub
    from huggingface_hub import constants

    reason = None
    if not constants.HF_HUB_OFFLINE:
        try:
            huggingface_hub.utils.get_session().head(constants.ENDPOINT, timeout=timeout_s)
        except Exception as error:  # noqa: BLE001 - whatever the client raises means no answer
            detail = str(error).strip().splitlines()
            reason = (
                f"{constants.ENDPOINT} cannot be reached "
                f"({detail[0] if detail else type(error).__name__}, {timeout_s:g} s limit)"
            )
    if reason is not None:
        # Read at import by both libraries; the environment for any process started from here.
        constants.HF_HUB_OFFLINE = True
        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        logger.debug("%s; using cached datasets only (HF_HUB_OFFLINE=1)", reason)
    _unreachable.append(reason)
    return reason


def unreachable_reason() -> str | None:
    """Why the hub was taken to be unreachable in this process, or None (answered, not asked)."""
    return _unreachable[0] if _unreachable else None
