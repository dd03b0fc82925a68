"""``ExpertLoRA``: a low-rank update per expert of a stacked expert weight.

For a stacked weight holding ``E`` expert matrices ``W_e`` (``[out, in]`` each) LoRA learns
``ΔW_e = scale * B_e A_e`` with ``A_e`` ``[r, in]`` and ``B_e`` ``[out, r]`` per expert (Hu et al.
2021, arXiv:2106.09685, applied expert by expert). The factors are stored as PEFT's
``ParamWrapper`` stores them for ``target_parameters``, so the adapter file needs no reshaping:

    lora_A.weight  [E * r, in]     A_e = lora_A[e * r : (e + 1) * r]
    lora_B.weight  [out, r * E]    B_e[o, k] = lora_B[o, k * E + e]   (rank-major columns)

The update is computed inside the experts' grouped matmuls: for rows sorted by expert,
``scale * (rows A_g^T) B_g^T`` is two more grouped matmuls of rank ``r``, no loop over experts.
``ΔW`` is never formed in the forward.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from tunelab.modules.moe import grouped_linear
from tunelab.peft.lora import _init_full_then_copy, lora_scale, validate_lora_options

EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")
"""The stacked expert weights LoRA can target, ``experts.<name>`` in ``lora.targets``."""


class _Factor(nn.Module):
    """Holds one factor as ``weight`` (the key PEFT uses), without being an ``nn.Linear``."""

    def __init__(self, shape: tuple[int, int], **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, **factory))


class ExpertLoRA(nn.Module):
    """The per-expert LoRA factors of one stacked expert weight (see the module docstring).

    ``MoEExperts`` holds it in ``experts.lora[<projection>]`` and adds ``delta`` to that
    projection's grouped matmul; the base weight stays the experts' own parameter. While
    ``disabled`` is set the experts skip it. Dropout and DoRA are not supported: PEFT's
    ``ParamWrapper`` implements neither, so such an adapter could not be loaded there.

    Args:
        num_experts: ``E``.
        in_dim: Each expert matrix's input features.
        out_dim: Each expert matrix's output features.
        rank: Adapter rank ``r``.
        alpha: LoRA ``alpha``.
        use_rslora: Scale by ``alpha / sqrt(r)``.
        transposed: The adapted weight is ``[E, in, out]`` (gpt-oss), not ``[E, out, in]``;
            the factors are the same, only a merge transposes the update.
        device: Where the factors live.
        dtype: Their dtype.

    Raises:
        ConfigError: If ``rank`` or ``alpha`` is out of range.
    """

    use_dora = False
    lora_magnitude_vector = None

    def __init__(
        self,
        num_experts: int,
        in_dim: int,
        out_dim: int,
        *,
        rank: int,
        alpha: float,
        use_rslora: bool = False,
        transposed: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        validate_lora_options(rank, alpha, 0.0)
        self.num_experts = num_experts
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.rank = rank
        self.alpha = alpha
        self.use_rslora = use_rslora
        self.scale = lora_scale(rank, alpha, use_rslora)
        self.transposed = transposed
        self.disabled = False
        factory = {"device": device, "dtype": dtype}
        self.lora_A = _Factor((num_experts * rank, in_dim), **factory)
        self.lora_B = _Factor((out_dim, rank * num_experts), **factory)
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """``A`` Kaiming-uniform (``a = sqrt(5)``, fan-in ``in``, as PEFT), ``B`` zeros.

        As ``LoRALinear.reset_lora_parameters``: each rank draws the whole factor, so a
        sharded run starts from the values of a one-process run with the same seed.
        """
        _init_full_then_copy(
            self.lora_A.weight, lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5))
        )
        _init_full_then_copy(self.lora_B.weight, nn.init.zeros_)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A [E, r, in], B [E, out, r])``, the per-expert factors."""
        return expert_factors(self.lora_A.weight, self.lora_B.weight, self.num_experts)

    def delta(
        self,
        rows: torch.Tensor,
        counts: torch.Tensor,
        grouped: bool | None,
        experts: slice = slice(None),
    ) -> torch.Tensor:
        """``scale * rows[i] A_g^T B_g^T`` for rows sorted by expert ``g``.

        Args:
            rows: ``[S, in]`` sorted by expert (the experts' own order).
            counts: int, rows per expert of ``experts``.
            grouped: ``grouped_linear``'s choice of kernel (None: where available).
            experts: The experts the rows are for (expert parallelism: this process's own);
                every expert by default.

        Returns:
            ``[S, out]`` in ``rows``' dtype.
        """
        lora_a, lora_b = self.lora_A.weight, self.lora_B.weight
        if isinstance(lora_a, DTensor):
            # Tensor parallelism: whole on every tp rank, each rank using its own experts'
            # slices; the gradients are partial sums, added over the ranks by DTensor.
            lora_a, lora_b = (w.to_local(grad_placements=[Partial()]) for w in (lora_a, lora_b))
        lora_a, lora_b = expert_factors(lora_a, lora_b, self.num_experts)
        lora_a, lora_b = lora_a[experts], lora_b[experts]
        lora_a, lora_b = lora_a.to(rows.dtype), lora_b.to(rows.dtype)
        low = grouped_linear(rows, lora_a, counts, grouped=grouped and _aligned(lora_a))
        return (
            grouped_linear(low, lora_b, counts, grouped=grouped and _aligned(lora_b)) * self.scale
        )

    def extra_repr(self) -> str:
        """The sizes and LoRA settings shown by ``print(module)``."""
        return (
            f"num_experts={self.num_experts}, in_dim={self.in_dim}, out_dim={self.out_dim}, "
            f"rank={self.rank}, alpha={self.alpha}, use_rslora={self.use_rslora}"
        )


def _aligned(weight: torch.Tensor) -> bool | None:
    # A rank whose rows are not 16-byte multiples has no grouped_mm kernel: None lets
    # grouped_linear fall back to the padded bmm instead of raising.
    return None if any(size * weight.element_size() % 16 for size in weight.shape[1:]) else True


def expert_factors(
    lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's stored factors as per-expert stacks.

    Args:
        lora_a: ``[E * r, in]``.
        lora_b: ``[out, r * E]`` (rank-major columns).
        num_experts: ``E``.

    Returns:
        ``(A [E, r, in], B [E, out, r])``; ``B`` is a contiguous copy.
    """
    rank = lora_a.shape[0] // num_experts
    lora_a = lora_a.reshape(num_experts, rank, lora_a.shape[-1])
    lora_b = lora_b.reshape(lora_b.shape[0], rank, num_experts).permute(2, 0, 1).contiguous()
    return lora_a, lora_b


def expert_delta(
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    num_experts: int,
    scale: float,
    experts: slice = slice(None),
    transposed: bool = False,
) -> torch.Tensor:
    """``scale * B_e A_e`` for the chosen experts, in fp32: the update a merge adds.

    Args:
        lora_a: ``[E * r, in]``, whole.
        lora_b: ``[out, r * E]``, whole.
        num_experts: ``E``.
        scale: The LoRA scale.
        experts: Which experts (a rank's ``Shard(0)`` slice of the stacked weight).
        transposed: The weight is ``[E, in, out]`` (gpt-oss): return ``(B_e A_e)^T``.

    Returns:
        ``[e, out, in]``, or ``[e, in, out]`` when ``transposed``.
    """
    a, b = expert_factors(lora_a.float(), lora_b.float(), num_experts)
    delta = torch.bmm(b[experts], a[experts]).mul_(scale)
    return delta.transpose(1, 2) if transposed else delta
