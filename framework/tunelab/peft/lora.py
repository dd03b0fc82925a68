"""``LoRALinear``: a frozen linear layer plus a trainable low-rank update.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685) keeps the pretrained weight ``W`` (``[out_dim, in_dim]``) frozen and
learns a rank-``r`` update ``ΔW = B A`` with ``A`` ``[r, in_dim]`` and ``B`` ``[out_dim, r]``:

    y = x W^T + b + scale * B(A(dropout(x)))

with ``scale = alpha / r``, or ``alpha / sqrt(r)`` for rank-stabilised LoRA (rsLoRA,
Kalajdzievski 2023, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA",
arXiv:2312.03732). ``A`` starts Kaiming-uniform (``a = sqrt(5)``, as PEFT does) and ``B``
at zero, so a fresh adapter leaves the model's output unchanged.

DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation", arXiv:2402.09353)
splits the adapted weight into a direction and a trainable magnitude ``m`` (one value per
output feature, initialised to the row norms of ``W``):

    W' = m / ||W + scale * B A||_row * (W + scale * B A)

where ``||.||_row`` is the L2 norm of each output row (over the input dimension). As in the
paper (section 4.3) and PEFT, the norm is a constant in backward (detached), so
``y = g * (x W^T) + g * scale * B(A(dropout(x))) + b`` with ``g = m / ||W + scale B A||_row``.
The base term uses ``dropout(x)`` only when dropout is active (training with ``p > 0``), as
PEFT does, so PEFT loads the adapter with the same outputs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tunelab.errors import ConfigError
from tunelab.modules import packed_linear
from tunelab.peft.nf4 import dequantize
from tunelab.peft.nf4 import linear as nf4_linear


def lora_scale(rank: int, alpha: float, use_rslora: bool) -> float:
    """The factor applied to ``B A``.

    Args:
        rank: The adapter rank ``r``.
        alpha: The LoRA ``alpha``.
        use_rslora: Use ``alpha / sqrt(r)`` (rsLoRA) instead of ``alpha / r``.

    Returns:
        ``alpha / sqrt(rank)`` with rsLoRA, else ``alpha / rank``.
    """
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def validate_lora_options(rank: int, alpha: float, dropout: float) -> None:
    """Check the LoRA hyper-parameters a user wrote in a config.

    Args:
        rank: Must be a positive integer.
        alpha: Must be a positive number.
        dropout: Must lie in ``[0, 1)``.

    Raises:
        ConfigError: Naming the first bad option.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"lora rank must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise ConfigError(f"lora alpha must be a positive number, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"lora dropout must be in [0, 1), got {dropout!r}")


def dora_weight_norm(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """``||W + scale * B A||`` per output row, in ``weight``'s dtype, without gradient.

    Rows are independent: ``weight`` and ``lora_b`` may be the same rows of larger tensors
    (an FSDP2 ``Shard(0)`` slice) with the whole ``lora_a``.

    Args:
        weight: Base rows ``[rows, in_dim]`` (an NF4 weight is dequantized).
        lora_a: Adapter ``A`` ``[rank, in_dim]``.
        lora_b: Adapter ``B`` rows ``[rows, rank]``.
        scale: The LoRA scale.

    Returns:
        ``[rows]`` norms.
    """
    with torch.no_grad():
        weight = dequantize(weight)
        delta = lora_b.to(weight.dtype) @ lora_a.to(weight.dtype)
        return torch.linalg.norm(weight + scale * delta, dim=1).to(weight.dtype)


def _init_full_then_copy(param: torch.Tensor, init_fn) -> None:
    """Initialise ``param`` as if it were one whole tensor, also when it is a sharded DTensor.

    Every rank draws the full (small) tensor from its own RNG, seeded alike by the recipe,
    and keeps its shard, so the values do not depend on the world size.
    """
    if param.is_meta:
        return
    if not isinstance(param, DTensor):
        init_fn(param)
        return
    local = param.to_local()
    full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
    init_fn(full)
    # src_data_rank=None: each rank slices its own copy, no communication.
    shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    local.copy_(shard.to_local())


class _AddUpdate(torch.autograd.Function):
    """``addmm(out, low, B^T, alpha=scale)`` with ``addmm``'s gradients, bit for bit.

    The gradients are the formulas of torch's ``addmm`` backward (``mm_mat1_backward``,
    ``mm_mat2_backward`` for a column-major ``B^T``): ``g`` for ``out``, ``scale * (g B)``
    for ``low``, ``scale * (g^T low)`` for ``B``. Only the last changes: autograd multiplies
    the transposed view ``g^T`` (``[out_dim, tokens]``, strides ``(1, out_dim)``), which MKL's
    sgemm runs at 3.6 GFLOP/s at GRPO's update shapes on this project's AVX2 EPYC (2048 x 832
    x 8: 7.6 ms on one core); in fp32 on CPU a contiguous copy of ``g^T`` gives the same bits
    in 4.0 ms (2048 x 1664 x 8: 22.6 against 8.5 ms), the copy included
    (tests/unit/test_lora_update_grad.py checks the bits at the tiny and wide shapes). In
    bf16 and fp16 the two layouts round differently, so they keep the view.
    """

    @staticmethod
    def forward(
        ctx, out: torch.Tensor, low: torch.Tensor, lora_b: torch.Tensor, scale: float
    ) -> torch.Tensor:
        ctx.save_for_backward(low, lora_b)
        ctx.scale = scale
        return torch.addmm(out, low, lora_b.t(), alpha=scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        low, lora_b = ctx.saved_tensors
        scale = ctx.scale
        need_out, need_low, need_b, _ = ctx.needs_input_grad
        # addmm's maybe_multiply: no pass over the product when alpha is 1.
        grad_low = grad.mm(lora_b) if need_low else None
        grad_b = None
        if need_b:
            transposed = grad.t()
            if grad.device.type == "cpu" and grad.dtype == torch.float32:
                transposed = transposed.contiguous()  # bf16/fp16 kernels round differently
            grad_b = transposed.mm(low)
        if scale != 1:
            grad_low = None if grad_low is None else grad_low * scale
            grad_b = None if grad_b is None else grad_b * scale
        return (grad if need_out else None), grad_low, grad_b, None


class LoRALinear(nn.Module):
    """A frozen linear layer with a trainable low-rank adapter.

    The base parameters are the module's own ``weight`` (and ``bias``), so the base
    checkpoint keys stay ``<name>.weight``; the adapter adds ``<name>.lora_A.weight`` and
    ``<name>.lora_B.weight``, the names PEFT uses. Forward:
    ``y = F.linear(x, weight, bias) + scale * lora_B(lora_A(dropout(x)))``; while
    ``disabled`` is set the adapter term is skipped, so the output is the base model's.
    Inside ``tunelab.peft.merged_adapters`` it computes one linear with a temporary merged
    weight instead (inference only; the rollout engine may hold it packed for oneDNN,
    :mod:`tunelab.modules.packed_linear`). Inside ``packed_linear.packed_frozen_linears`` (a
    training pass) the base term runs on packed copies of the frozen ``weight``.
    With ``use_dora`` it also has ``lora_magnitude_vector`` (``[out_dim]``, PEFT's name) and
    computes DoRA (see the module docstring). The base ``weight`` may be a torchao
    ``NF4Tensor`` (QLoRA), or a tensor-parallel ``DTensor`` of one; it is dequantized on the
    fly (``tunelab.peft.nf4.linear``).

    Args:
        in_dim: Input features.
        out_dim: Output features.
        rank: Adapter rank ``r``.
        alpha: LoRA ``alpha``; the update is scaled by ``alpha / r``.
        dropout: Dropout probability applied to the adapter's input only.
        use_rslora: Scale by ``alpha / sqrt(r)`` instead (rsLoRA).
        bias: Whether the base layer has a bias.
        use_dora: Add DoRA's trainable magnitude vector.

    Raises:
        ConfigError: If ``rank``, ``alpha`` or ``dropout`` is out of range.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        bias: bool = False,
        use_dora: bool = False,
    ) -> None:
        super().__init__()
        validate_lora_options(rank, alpha, dropout)
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.rank = rank
        self.alpha = alpha
        self.use_rslora = use_rslora
        self.scale = lora_scale(rank, alpha, use_rslora)
        self.use_dora = use_dora
        self.disabled = False
        # Set only inside ``tunelab.peft.merged_adapters`` (inference): W + scale * B A.
        self.merged_weight: torch.Tensor | None = None
        # Set only inside ``packed_linear.packed_frozen_linears`` (a training pass): where
        # the base term's matmuls find oneDNN-packed copies of the frozen W.
        self.pack_frozen: packed_linear._FrozenPacks | None = None
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_dim), requires_grad=False) if bias else None
        self.dropout = nn.Dropout(dropout) if dropout > 0.0 else nn.Identity()
        self.lora_A = nn.Linear(in_dim, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_dim, bias=False)
        self.lora_magnitude_vector = nn.Parameter(torch.empty(out_dim)) if use_dora else None
        self._reset_base_parameters()
        self.reset_lora_parameters()

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        use_dora: bool = False,
    ) -> LoRALinear:
        """Wrap an existing ``nn.Linear``, reusing (not copying) its parameters.

        Sharing the very ``Parameter`` objects keeps tied weights tied (a tied ``lm_head``
        still shares the embedding) and costs no memory. The base is frozen.

        Args:
            linear: The layer to adapt; may live on the meta device.
            rank: Adapter rank ``r``.
            alpha: LoRA ``alpha``.
            dropout: Dropout probability on the adapter input.
            use_rslora: Use the rsLoRA scale ``alpha / sqrt(r)``.
            use_dora: Add DoRA's magnitude vector.

        Returns:
            A ``LoRALinear`` whose adapter lives on the base weight's device and dtype.
        """
        weight = linear.weight
        with torch.device("meta"):
            module = cls(
                linear.in_features,
                linear.out_features,
                rank=rank,
                alpha=alpha,
                dropout=dropout,
                use_rslora=use_rslora,
                bias=linear.bias is not None,
                use_dora=use_dora,
            )
        module.weight = weight
        module.bias = linear.bias
        factory = {"device": weight.device, "dtype": weight.dtype}
        module.lora_A = nn.Linear(linear.in_features, rank, bias=False, **factory)
        module.lora_B = nn.Linear(rank, linear.out_features, bias=False, **factory)
        if use_dora:
            module.lora_magnitude_vector = nn.Parameter(torch.empty(linear.out_features, **factory))
        module.weight.requires_grad_(False)
        if module.bias is not None:
            module.bias.requires_grad_(False)
        module.reset_lora_parameters()
        return module

    def _reset_base_parameters(self) -> None:
        # nn.Linear's own init, so a standalone module is never uninitialised memory; real
        # runs overwrite the base from a checkpoint.
        _init_full_then_copy(self.weight, lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_dim) if self.in_dim > 0 else 0.0
            _init_full_then_copy(self.bias, lambda t: nn.init.uniform_(t, -bound, bound))

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """(Re-)initialise the adapter: ``A`` Kaiming-uniform (``a = sqrt(5)``), ``B`` zeros.

        Call it after ``model.to_empty(...)`` when the model was built on the meta device,
        and, with DoRA, after the base weight is loaded: the magnitude starts at the row norms
        of ``W`` (``B`` is zero). It also works after ``fully_shard``: each rank draws the
        whole ``A`` from its RNG and keeps its rows, so with the same seed the values match a
        one-process run, and each rank takes the norms of its own rows of ``W``, which are
        the rows of the magnitude it holds (both are ``Shard(0)`` over ``out_dim``).
        """
        _init_full_then_copy(
            self.lora_A.weight, lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5))
        )
        _init_full_then_copy(self.lora_B.weight, nn.init.zeros_)
        magnitude = self.lora_magnitude_vector
        if magnitude is None or magnitude.is_meta or self.weight.is_meta:
            return
        local = magnitude.to_local() if isinstance(magnitude, DTensor) else magnitude
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        # B is zero, so ||W + scale B A|| is ||W||: no need for the gathered A here.
        norm = torch.linalg.norm(dequantize(weight), dim=1)
        if isinstance(self.weight, DTensor):
            # Tensor parallel, row-wise: each rank holds some columns of every row, so the
            # squared norms of the pieces add up over those ranks.
            for dim, placement in enumerate(self.weight.placements):
                if placement.is_shard(1):
                    squares = norm.square()
                    dist.all_reduce(squares, group=self.weight.device_mesh.get_group(dim))
                    norm = squares.sqrt()
        local.copy_(norm.to(local.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the base layer and, unless disabled, the scaled adapter.

        Args:
            x: Input ``[..., in_dim]``.

        Returns:
            Output ``[..., out_dim]``.
        """
        if self.merged_weight is not None and not self.disabled:
            return packed_linear.linear(x, self.merged_weight, self.bias)
        if self.pack_frozen is not None:
            out = packed_linear.frozen_linear(x, self.weight, self.bias, self.pack_frozen)
        else:
            out = nf4_linear(x, self.weight, self.bias)
        if self.disabled:
            return out
        if self.lora_magnitude_vector is None:
            return self._add_update(out, self.lora_A(self._dropout(x)))
        return out + self._dora_term(x, out)

    def _add_update(self, out: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        """``out + scale * lora_B(low)``: one ``addmm`` on plain tensors.

        ``addmm`` writes the scaled update into a copy of ``out`` in the matmul itself, so the
        ``[tokens, out_dim]`` product is never scaled and added in passes of its own (forward),
        and its gradient is not scaled in one either (backward: ``alpha`` scales the
        ``[tokens, rank]`` and ``[out_dim, rank]`` gradients instead). DTensors (tensor
        parallelism) and mixed dtypes take the module call.

        The backward is ``addmm``'s own, with one change of layout (:class:`_AddUpdate`):
        ``B``'s gradient ``(g^T low)`` multiplies a contiguous copy of ``g^T``, not the
        transposed view, which gives the same bits (MKL packs either the same way) in about
        half the time at the update's wide shapes. Computed as ``low^T g`` instead it would
        be 8x faster (2048 x 1664 x 8: 1.8 against 15.1 ms on one core), but that other
        rounding moved a LoRA run resumed on 1 process from its 2-process reference past the
        1e-5 the exactness tests hold (1.66e-5, test_lifecycle_runs, test_sft_recipes): not
        taken.
        """
        lora_b = self.lora_B.weight
        plain = type(out) is torch.Tensor and type(low) is torch.Tensor
        if not plain or isinstance(lora_b, DTensor) or not out.dtype == low.dtype == lora_b.dtype:
            return out + self.lora_B(low) * self.scale
        rows = _AddUpdate.apply(
            out.reshape(-1, out.shape[-1]), low.reshape(-1, low.shape[-1]), lora_b, self.scale
        )
        return rows.view(out.shape)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's dropout; on a ``DTensor`` input, the whole tensor's mask cut to it.

        Under tensor parallelism the input is whole on every rank (a column-wise base) or
        split over its features (a row-wise one). Each rank draws the mask of the whole
        input, as one process would (``bernoulli_(1 - p)``, then ``/ (1 - p)``: what
        ``F.dropout`` does on CPU), and keeps its part, so every rank applies the same mask
        to the same features. The ranks start from the same seed and draw alike.
        """
        if not isinstance(x, DTensor) or not self.training or isinstance(self.dropout, nn.Identity):
            return self.dropout(x)
        p = self.dropout.p
        noise = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
        noise.div_(1 - p)
        # src_data_rank=None: each rank cuts its own copy, no communication.
        return x * distribute_tensor(noise, x.device_mesh, x.placements, src_data_rank=None)

    def _dora_term(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``(g - 1) * x W^T + g * scale * B(A(x))``, added to the base output (PEFT's form)."""
        norm = dora_weight_norm(self.weight, self.lora_A.weight, self.lora_B.weight, self.scale)
        gain = self.lora_magnitude_vector / norm.to(x.dtype)
        if isinstance(self.dropout, nn.Identity) or not self.training:
            base = out if self.bias is None else out - self.bias
            adapter_input = x
        else:
            adapter_input = self._dropout(x)
            base = nf4_linear(adapter_input, self.weight)
        lora = self.lora_B(self.lora_A(adapter_input))
        return (gain - 1) * base + gain * lora * self.scale

    def extra_repr(self) -> str:
        """The sizes and LoRA settings shown by ``print(module)``."""
        return (
            f"in_dim={self.in_dim}, out_dim={self.out_dim}, rank={self.rank}, "
            f"alpha={self.alpha}, use_rslora={self.use_rslora}, bias={self.bias is not None}, "
            f"use_dora={self.use_dora}"
        )
