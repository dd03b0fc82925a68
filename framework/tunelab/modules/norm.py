"""Root-mean-square layer normalisation."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm (Zhang and Sennrich, 2019, https://arxiv.org/abs/1910.07467).

    ``y = weight * x / sqrt(mean(x**2, dim=-1) + eps)``. The statistic is computed in fp32 and
    the result cast back to the input dtype before the weight is applied, which is the order
    Hugging Face Llama/Qwen2 use; keeping it makes bf16 logits match theirs bit for bit.

    With ``unit_offset`` (Gemma) the scale is ``1 + weight`` (the weight starts at zero) and is
    applied in fp32 before the cast back, again HF's order for that family. With
    ``scale_in_fp32`` (gpt-oss, whose norms transformers keeps in fp32) ``weight`` is applied in
    fp32 before the cast back.

    Args:
        dim: size of the last dimension.
        eps: added to the mean square for numerical stability.
        unit_offset: scale by ``1 + weight`` in fp32 (Gemma) instead of ``weight``.
        scale_in_fp32: apply ``weight`` in fp32, then cast (gpt-oss).
    """

    def __init__(
        self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False, scale_in_fp32: bool = False
    ) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.scale_in_fp32 = scale_in_fp32
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def reset_parameters(self) -> None:
        """Set the scale to one."""
        if self.unit_offset:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its last dimension.

        Args:
            x: input of shape ``[..., dim]``.

        Returns:
            The normalised tensor, same shape and dtype as ``x``.
        """
        input_dtype = x.dtype
        if input_dtype == torch.float32 and not self.unit_offset:
            # The same operations as below, without the two casts that are no-ops in fp32.
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(input_dtype)
        if self.scale_in_fp32:
            return (self.weight.float() * x32).to(input_dtype)
        return self.weight * x32.to(input_dtype)

    def extra_repr(self) -> str:
        """Shown by ``print(module)``."""
        offset = ", unit_offset=True" if self.unit_offset else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{offset}"
