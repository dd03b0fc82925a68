"""RNG state capture and restore, so a resumed run draws the same random numbers.

It lives below both checkpointing (which saves the states) and training (which seeds).
"""

import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """Return this process's RNG states as tensors and plain values."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states captured by :func:`rng_state`."""
    random.setstate(_as_python_state(state["python"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_python_state(value: Any) -> tuple:
    # A round trip through a checkpoint turns tuples into lists.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)
