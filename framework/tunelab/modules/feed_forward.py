"""The gated feed-forward block (SwiGLU, GeGLU)."""

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tunelab.modules import packed_linear

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
"""Gate activations by their Hugging Face ``hidden_act`` name."""

_GELU_TANH_LINEAR = 2 * math.sqrt(2 / math.pi)
_GELU_TANH_CUBIC = _GELU_TANH_LINEAR * 0.044715


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (``gelu_pytorch_tanh``), quicker on CPU without autograd.

    ``0.5 * x * (1 + tanh(u))`` is ``x * sigmoid(2 * u)``, ``u = sqrt(2 / pi) * (x + 0.044715 *
    x**3)``. For an fp32 CPU tensor that needs no gradient (a frozen tower) that is five
    passes in place over one buffer, about 0.6x of ``F.gelu(approximate="tanh")``'s time on
    one AVX2 core (its vectorised ``tanh`` is the slow part), equal to it within fp32 rounding
    (a few 1e-7). Otherwise (autograd, whose backward ``F.gelu`` fuses; a GPU, where ``F.gelu``
    is one kernel; bf16, whose in-place passes would round five times) it is ``F.gelu``.

    Args:
        x: any shape.

    Returns:
        ``gelu(x, approximate="tanh")``, ``x``'s shape and dtype.
    """
    quick = x.device.type == "cpu" and x.dtype == torch.float32
    if not quick or (torch.is_grad_enabled() and x.requires_grad):
        return F.gelu(x, approximate="tanh")
    inner = x * x
    return inner.mul_(_GELU_TANH_CUBIC).add_(_GELU_TANH_LINEAR).mul_(x).sigmoid_().mul_(x)


def tower_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A vision tower MLP's activation by its ``hidden_act`` name (``ACTIVATIONS``' keys).

    ``gelu_pytorch_tanh`` is ``gelu_tanh``: a frozen tower (no autograd) on CPU in fp32 runs
    its quicker form.
    """
    return gelu_tanh if name == "gelu_pytorch_tanh" else ACTIVATIONS[name]


class FeedForward(nn.Module):
    """Gated MLP: SwiGLU (Shazeer, 2020, https://arxiv.org/abs/2002.05202) or GeGLU.

    ``down_proj(act(gate_proj(x)) * up_proj(x))``; names match Hugging Face ``LlamaMLP``. With
    ``fused`` (Phi-3) one ``gate_up_proj`` computes both halves, gate first, so its weight is the
    checkpoint's fused tensor and LoRA on it is PEFT's LoRA on ``gate_up_proj``.

    Args:
        dim: model (input and output) dimension.
        intermediate_dim: hidden dimension of the gated projection.
        bias: whether the projections carry a bias.
        activation: the gate's activation, a key of ``ACTIVATIONS``.
        fused: one ``gate_up_proj`` instead of ``gate_proj`` and ``up_proj``.
    """

    def __init__(
        self,
        dim: int,
        intermediate_dim: int,
        bias: bool = False,
        *,
        activation: str = "silu",
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.activation = ACTIVATIONS[activation]
        self.fused = fused
        if fused:
            self.gate_up_proj = nn.Linear(dim, 2 * intermediate_dim, bias=bias)
        else:
            self.gate_proj = nn.Linear(dim, intermediate_dim, bias=bias)
            self.up_proj = nn.Linear(dim, intermediate_dim, bias=bias)
        self.down_proj = nn.Linear(intermediate_dim, dim, bias=bias)
        self.packed_projection: packed_linear.PackedProjection | None = None
        """Set only inside ``packed_linears``: gate and up as one packed matrix."""

    def sibling_projections(self) -> list[nn.Module]:
        """The projections of one input that ``packed_linears`` may run as one matmul."""
        return [] if self.fused else [self.gate_proj, self.up_proj]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block.

        Args:
            x: input of shape ``[..., dim]``.

        Returns:
            Output of shape ``[..., dim]``.
        """
        if self.packed_projection is not None:
            gate, up = self.packed_projection(x)
        elif self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.activation(gate) * up)
