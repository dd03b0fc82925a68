"""Optimizer construction."""

import inspect
from collections.abc import Iterable

import torch
from torch import nn


def adamw(
    params: Iterable[nn.Parameter],
    *,
    lr: float = 2e-5,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019), fused where the device supports it.

    Args:
        params: The trainable parameters (supplied by the recipe).
        lr: Peak learning rate.
        betas: Adam's moment decay rates.
        eps: Adam's denominator epsilon.
        weight_decay: Decoupled weight decay.
        fused: Force the fused kernel on or off; None picks it on CUDA, the default
            ``foreach`` path elsewhere (fused CPU AdamW gains little on small models).

    Returns:
        The optimizer.
    """
    params = list(params)
    if fused is None:
        fused = bool(params) and params[0].device.type == "cuda"
    kwargs = (
        {"fused": True}
        if fused and "fused" in inspect.signature(torch.optim.AdamW).parameters
        else {}
    )
    return torch.optim.AdamW(
        params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **kwargs
    )
