"""The SwiGLU feed-forward block."""

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer, 2020, https://arxiv.org/abs/2002.05202).

    ``down_proj(silu(gate_proj(x)) * up_proj(x))``; names match Hugging Face ``LlamaMLP``.

    Args:
        dim: model (input and output) dimension.
        intermediate_dim: hidden dimension of the gated projection.
        bias: whether the three projections carry a bias.
    """

    def __init__(self, dim: int, intermediate_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, intermediate_dim, bias=bias)
        self.up_proj = nn.Linear(dim, intermediate_dim, bias=bias)
        self.down_proj = nn.Linear(intermediate_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block.

        Args:
            x: input of shape ``[..., dim]``.

        Returns:
            Output of shape ``[..., dim]``.
        """
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
