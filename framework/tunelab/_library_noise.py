"""Known noise of the libraries tunelab uses, silenced once when ``tunelab`` is imported.

A normal run prints nothing a user cannot act on. Each entry here is a message that a library
prints on every run, is not about the user's setup, and has been read and judged harmless for
tunelab's use; nothing else is hidden. ``TUNELAB_SHOW_LIBRARY_WARNINGS=1`` shows them all again
(docs/recipes.md, "Library warnings").

- torchao's prebuilt C++ kernels (``_C_mxfp8``, ``_C_cutlass_90a``) are built for other torch
  builds: loading them fails with a ``Failed to load ...so`` line per file and process.
  tunelab uses torchao's NF4 tensor only, which is pure PyTorch, so the kernels are skipped
  (``TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1``, unless the environment sets it) and the line
  saying so is dropped.
- torch 2.13 warns when torchao registers its ``KernelPreference`` enum as a pytree constant
  (``register_constant() on Enum subclasses is deprecated``): torchao's call, not ours.
"""

from __future__ import annotations

import logging
import os

SHOW_ENV = "TUNELAB_SHOW_LIBRARY_WARNINGS"
"""Set to 1 to see the library messages tunelab silences."""

TORCHAO_SKIP_ENV = "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"

# Logger name -> the start of each message dropped from it.
_DROPPED: dict[str, tuple[str, ...]] = {
    "torchao": ("Skipping import of cpp extensions due to TORCHAO_FORCE_SKIP_LOADING_SO_FILES",),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
}


class _Drop(logging.Filter):
    """Drops the records of one logger whose message template starts with a known prefix."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def silence_known_library_noise() -> None:
    """Skip torchao's prebuilt kernels and drop the known library messages; idempotent.

    Must run before torchao is imported (it reads the variable at import); the root
    ``tunelab`` module calls it, so any ``import tunelab...`` does. With
    ``TUNELAB_SHOW_LIBRARY_WARNINGS=1`` it does nothing: every message shows, as without tunelab.
    """
    if os.environ.get(SHOW_ENV, "") not in ("", "0"):
        return
    # Inherited by every process tunelab starts (torchrun's workers, the 1-process child).
    os.environ.setdefault(TORCHAO_SKIP_ENV, "1")
    for name, prefixes in _DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _Drop) for existing in logger.filters):
            logger.addFilter(_Drop(prefixes))
