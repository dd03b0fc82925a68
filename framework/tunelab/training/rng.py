"""Seeding, and the RNG state helpers (defined in ``tunelab._rng``, re-exported here)."""

import random

import torch

from tunelab._rng import rng_state, set_rng_state

__all__ = ["rng_state", "seed_everything", "set_rng_state"]


def seed_everything(seed: int) -> None:
    """Seed Python, torch CPU and CUDA generators."""
    random.seed(seed)
    torch.manual_seed(seed)
