"""Mixture-of-experts feed-forward: a top-k router and experts run as grouped matmuls.

Each token goes to the ``top_k`` experts of highest router probability (Shazeer et al., 2017,
https://arxiv.org/abs/1701.06538; Mixtral, https://arxiv.org/abs/2401.04088) and its output is
``sum_j w_j * expert_j(x)``. The experts' weights are stacked, ``gate_up_proj`` ``[E, 2I, D]``
(gate rows first) and ``down_proj`` ``[E, D, I]``, as transformers 5 holds them. The
(token, expert) pairs are sorted by expert once per layer, and each projection is one grouped
matmul over the sorted rows (``torch.nn.functional.grouped_mm`` where the device and dtype
have a kernel, else one padded ``bmm``): no Python loop over experts, and no capacity limit
(no token is ever dropped).

gpt-oss (``expert_layout="gpt_oss"``) holds its experts as transformers'
``GptOssExperts`` does: ``gate_up_proj`` ``[E, D, 2I]`` (input dimension first) with the gate
and up columns interleaved, ``down_proj`` ``[E, I, D]``, and a bias per expert and
projection; its router has a bias, and its experts gate with a clamped SwiGLU.

The router's load-balancing loss (Switch Transformer, Fedus et al., 2021,
https://arxiv.org/abs/2101.03961, eq. 4-6) is gathered across layers by ``RouterStats``, the
way transformers' ``load_balancing_loss_func`` computes it, and so is the router z-loss
(ST-MoE, Zoph et al., 2022, https://arxiv.org/abs/2202.08906, eq. 5).
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tunelab.modules.feed_forward import ACTIVATIONS


def _grouped_mm_available(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` has a kernel for these operands.

    Measured with torch 2.13 on CPU: fp32 and bf16, forward and backward, but only when every
    row stride is a multiple of 16 bytes (``in`` and ``out`` of 4 fp32 or 8 bf16 elements)
    and the data 16-byte aligned; otherwise it raises.
    """
    function = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if function is None or rows.dtype != weight.dtype:
        return False
    element = weight.element_size()
    if any(size * element % 16 for size in weight.shape[1:]) or any(
        tensor.data_ptr() % 16 for tensor in (rows, weight)
    ):
        return False
    if weight.device.type == "cpu":
        return weight.dtype in (torch.float32, torch.bfloat16)
    if weight.device.type == "cuda":
        return weight.dtype == torch.bfloat16 and torch.cuda.get_device_capability(
            weight.device
        ) >= (
            8,
            0,
        )
    return False


def grouped_linear(
    rows: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    *,
    grouped: bool | None = None,
    transposed: bool = False,
) -> torch.Tensor:
    """``rows[i] @ weight[g(i)].T`` for rows sorted by group: one grouped matmul.

    Args:
        rows: ``[S, in]``, sorted so group ``g``'s rows are contiguous and in group order.
        weight: ``[G, out, in]``, one matrix per group (a ``nn.Linear`` weight each), or
            ``[G, in, out]`` when ``transposed`` (then ``rows[i] @ weight[g(i)]``).
        counts: int ``[G]``, rows per group (summing to ``S``; zeros allowed).
        grouped: use ``grouped_mm`` (True) or the padded ``bmm`` (False); None picks
            ``grouped_mm`` where it has a kernel.
        transposed: ``weight`` is ``[G, in, out]`` (gpt-oss's experts).

    Returns:
        ``[S, out]``.
    """
    right = weight if transposed else weight.transpose(-2, -1)
    if grouped is None:
        grouped = _grouped_mm_available(rows, weight)
    if grouped:
        function = getattr(F, "grouped_mm", None) or torch._grouped_mm
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return function(rows, right, offs=offsets)
    return _padded_bmm(rows, right, counts)


class _UnpackedGroupedLinear(torch.autograd.Function):
    """``grouped_linear`` over a frozen weight kept packed (quantized) between uses.

    The weight is unpacked in the forward and again in the backward, and only the packed form
    is saved for the backward (as torchao's ``linear_nf4`` does for one NF4 linear): one
    projection's experts of one layer exist in full precision for one matmul at a time. ``rows`` gets the
    gradient ``grad[i] @ W[g(i)]``, the weight none.
    """

    @staticmethod
    def forward(ctx, rows, packed, counts, unpack, num_groups, grouped, transposed):
        ctx.save_for_backward(packed, counts)
        ctx.unpack, ctx.num_groups = unpack, num_groups
        ctx.grouped, ctx.transposed = grouped, transposed
        weight = _unpacked(unpack, packed, num_groups, rows.dtype)
        return grouped_linear(rows, weight, counts, grouped=grouped, transposed=transposed)

    @staticmethod
    def backward(ctx, grad):
        packed, counts = ctx.saved_tensors
        weight = _unpacked(ctx.unpack, packed, ctx.num_groups, grad.dtype)
        # rows @ W^T's input gradient is grad @ W: the same weight read the other way round.
        grad_rows = grouped_linear(
            grad.contiguous(), weight, counts, grouped=ctx.grouped, transposed=not ctx.transposed
        )
        return grad_rows, None, None, None, None, None, None


def _unpacked(
    unpack: Callable[[torch.Tensor], torch.Tensor],
    packed: torch.Tensor,
    num_groups: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    weight = unpack(packed)
    return weight.view(num_groups, -1, weight.shape[-1]).to(dtype)


def _padded_bmm(rows: torch.Tensor, right: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``grouped_linear`` as one ``bmm`` over groups padded to the largest group.

    ``right`` is ``[G, in, out]`` (the weights already transposed where needed).
    """
    num_groups = right.shape[0]
    starts = torch.cumsum(counts, dim=0) - counts
    group_of_row = torch.repeat_interleave(torch.arange(num_groups, device=rows.device), counts)
    slot = torch.arange(rows.shape[0], device=rows.device) - starts[group_of_row]
    width = int(counts.max()) if rows.shape[0] else 0
    padded = rows.new_zeros(num_groups, width, rows.shape[1])
    padded = padded.index_put((group_of_row, slot), rows)
    out = torch.bmm(padded, right)
    return out[group_of_row, slot]


class RouterStats:
    """Gathers the router statistics of one forward for the load-balancing loss.

    ``loss = E * sum_e f_e * P_e`` (Switch Transformer eq. 4), where over all MoE layers and
    counted tokens ``f_e`` is the fraction of top-k assignments that went to expert ``e`` (the
    ``f_e`` sum to ``top_k``) and ``P_e`` the mean router probability of ``e``. Sums are
    taken over layers first and divided once, exactly as transformers'
    ``load_balancing_loss_func``; ``valid`` plays its ``attention_mask``: padding tokens are not
    counted, and the tokens of packed documents all are.

    It also gathers the router z-loss (ST-MoE eq. 5), ``z_loss()``: the mean over MoE layers
    and counted tokens of ``logsumexp(router logits)^2``, which keeps the logits small (as
    transformers' ``router_z_loss_func`` over all layers' logits, with padding left out).

    Pass one to ``TransformerDecoder.forward(router_stats=...)``, then read ``loss()`` and
    ``z_loss()``.

    Args:
        valid: bool or 0/1 ``[batch, seq]``, the tokens to count; None counts every token.
        sum_over_ranks: context parallelism: sums a tensor over the ranks that split the
            sequences (``ContextParallel.sum_over_group``), so ``f_e`` and ``P_e`` are those of
            the whole rows; each rank's gradient then flows into its own tokens' router
            probabilities only. None: the rows are whole here.
    """

    def __init__(
        self,
        valid: torch.Tensor | None = None,
        sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.valid = valid
        self.sum_over_ranks = sum_over_ranks
        self.num_experts = 0
        self.num_layers = 0
        self._assigned: torch.Tensor | None = None
        self._probabilities: torch.Tensor | None = None
        self._rows: torch.Tensor | float = 0.0
        self._squared_log_z: torch.Tensor | float = 0.0
        self._logit_rows: torch.Tensor | float = 0.0

    def add(
        self,
        probabilities: torch.Tensor,
        top_indices: torch.Tensor,
        logits: torch.Tensor | None = None,
    ) -> None:
        """Record one MoE layer.

        Args:
            probabilities: fp32 ``[tokens, E]`` router softmax, tokens in ``[batch, seq]``
                order (gradients flow through it into the router).
            top_indices: long ``[tokens, top_k]``, the experts each token went to.
            logits: ``[tokens, E]`` router logits, for the z-loss (None: not recorded).
        """
        num_experts = probabilities.shape[-1]
        if self.valid is None:
            weight = probabilities.new_ones(probabilities.shape[0])
        else:
            weight = self.valid.reshape(-1).to(probabilities.device, torch.float32)
        assigned = torch.zeros(num_experts, dtype=torch.float32, device=probabilities.device)
        assigned = assigned.scatter_add(
            0, top_indices.reshape(-1), weight.repeat_interleave(top_indices.shape[-1])
        )
        summed = (probabilities.float() * weight[:, None]).sum(dim=0)
        if self._assigned is None:
            self.num_experts = num_experts
            self._assigned, self._probabilities = assigned, summed
        else:
            self._assigned = self._assigned + assigned
            self._probabilities = self._probabilities + summed
        self._rows = self._rows + weight.sum()
        self.num_layers += 1
        if logits is not None:
            log_z = torch.logsumexp(logits.float(), dim=-1)
            self._squared_log_z = self._squared_log_z + (log_z.square() * weight).sum()
            self._logit_rows = self._logit_rows + weight.sum()

    def loss(self) -> torch.Tensor:
        """The load-balancing loss (before ``router_aux_loss_coef``); 0 with no MoE layer.

        Returns:
            A scalar fp32 tensor.
        """
        if self._assigned is None:
            return torch.zeros(())
        assigned, probabilities, rows = self._assigned, self._probabilities, self._rows
        if self.sum_over_ranks is not None:
            local = torch.cat([assigned, probabilities.detach(), rows.reshape(1).float()])
            total = self.sum_over_ranks(local.detach())
            num_experts = assigned.shape[0]
            assigned, rows = total[:num_experts], total[-1]
            # The whole rows' sum as value, this rank's own probabilities as gradient path.
            others = total[num_experts:-1] - probabilities.detach()
            probabilities = probabilities + others
        fraction = assigned / rows
        probability = probabilities / rows
        return (fraction * probability).sum() * self.num_experts

    def z_loss(self) -> torch.Tensor:
        """The router z-loss (before ``router_z_loss_coef``); 0 with no recorded logits.

        Returns:
            A scalar fp32 tensor: ``sum_layers sum_tokens w_t * logsumexp(l_t)^2 /
            sum_layers sum_tokens w_t`` with ``w_t`` the ``valid`` mask.
        """
        if not isinstance(self._squared_log_z, torch.Tensor):
            return torch.zeros(())
        squared, rows = self._squared_log_z, self._logit_rows
        if self.sum_over_ranks is not None:
            total = self.sum_over_ranks(torch.stack([squared.detach(), rows.float()]))
            # The whole rows' value, this rank's own tokens as the gradient path.
            squared, rows = squared + (total[0] - squared.detach()), total[1]
        return squared / rows


class MoERouter(nn.Linear):
    """The router's linear layer, ``weight`` ``[E, D]`` (HF's ``mlp.gate.weight``).

    A plain ``nn.Linear`` that LoRA can target by name (``gate``), but which ``all-linear``
    leaves out and QLoRA keeps in the training dtype: its few weights decide the routing.
    ``MoEBlock.route`` turns its logits into each token's experts.

    Args:
        dim: model dimension.
        num_experts: experts to choose from.
        bias: a bias per expert (gpt-oss).
    """

    def __init__(self, dim: int, num_experts: int, bias: bool = False) -> None:
        super().__init__(dim, num_experts, bias=bias)


EXPERT_LAYOUTS = ("stacked", "gpt_oss")
"""How ``MoEExperts`` holds its weights (see the module docstring)."""


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float
) -> torch.Tensor:
    """gpt-oss's gate: ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, l)``.

    The SwiGLU of the gpt-oss experts (OpenAI, 2025, gpt-oss model card,
    https://arxiv.org/abs/2508.10925): the gate is clamped from above and the up projection on
    both sides at ``limit`` (``swiglu_limit``, 7.0), the sigmoid has gain ``alpha``
    (``swiglu_alpha``, 1.702) and the up projection is offset by one.
    """
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MoEExperts(nn.Module):
    """``E`` gated MLPs with stacked weights, run as grouped matmuls.

    Expert ``e`` computes ``down(act(gate) * up)`` with ``gate, up = split(gate_up(x))``,
    HF's ``Qwen3MoeExperts``/``MixtralExperts`` (``layout="stacked"``: ``gate_up_proj``
    ``[E, 2I, D]`` gate rows first, ``down_proj`` ``[E, D, I]``) or ``GptOssExperts``
    (``layout="gpt_oss"``: ``gate_up_proj`` ``[E, D, 2I]`` with gate and up columns
    interleaved, ``down_proj`` ``[E, I, D]``). With ``bias`` each projection adds its expert's
    ``gate_up_proj_bias`` ``[E, 2I]`` / ``down_proj_bias`` ``[E, D]``; with ``swiglu_limit``
    the gate is ``clamped_swiglu`` instead of ``act(gate) * up``.

    Args:
        dim: model dimension.
        intermediate_dim: each expert's hidden dimension.
        num_experts: number of experts.
        activation: the gate's activation, a key of ``ACTIVATIONS``.
        layout: one of ``EXPERT_LAYOUTS``.
        bias: biases on both projections (gpt-oss).
        swiglu_limit: gpt-oss's clamp; None for the plain gate.
        swiglu_alpha: gpt-oss's sigmoid gain (with ``swiglu_limit``).
    """

    def __init__(
        self,
        dim: int,
        intermediate_dim: int,
        num_experts: int,
        *,
        activation: str = "silu",
        layout: str = "stacked",
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
    ) -> None:
        super().__init__()
        if layout not in EXPERT_LAYOUTS:
            raise ValueError(f"expert layout must be one of {EXPERT_LAYOUTS}, got {layout!r}")
        self.num_experts = num_experts
        self.intermediate_dim = intermediate_dim
        self.activation = ACTIVATIONS[activation]
        self.transposed = layout == "gpt_oss"
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        gate_up, down = (2 * intermediate_dim, dim), (dim, intermediate_dim)
        if self.transposed:
            gate_up, down = gate_up[::-1], down[::-1]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, *gate_up))
        self.down_proj = nn.Parameter(torch.empty(num_experts, *down))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, dim))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.grouped: bool | None = None
        """``grouped_linear``'s choice: None picks ``grouped_mm`` where it has a kernel."""
        self.unpack_weight: Callable[[torch.Tensor], torch.Tensor] | None = None
        """QLoRA (``tunelab.peft.nf4``) stores frozen expert weights packed, 2-D ``[E * rows,
        cols]`` (each ``[E, rows, cols]`` weight's experts one after another, so FSDP2's
        ``Shard(0)`` still splits whole experts): this maps the packed tensor to its values,
        ``[E * rows, cols]``, each time a projection runs. None: the weights are plain."""
        self.expert_parallel: Any = None
        """Expert parallelism (``tunelab.distributed.expert_parallel.ExpertParallel``, put here
        by ``shard_experts``): this rank holds only its experts' slices (``Shard(0)``), and
        ``forward`` sends each row to its expert's owner and back. None: every expert is
        here."""
        self.lora = nn.ModuleDict()
        """LoRA on a projection, by its name (``tunelab.peft.ExpertLoRA``, put here by
        ``apply_lora``): ``delta(rows, counts, grouped)`` is added to its grouped matmul unless
        the adapter is ``disabled``. Empty without LoRA (no state-dict key)."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise each expert's matrices as ``nn.Linear`` would; biases to zero."""
        for weight in (self.gate_up_proj, self.down_proj):
            fan_in = weight.shape[1] if self.transposed else weight.shape[-1]
            bound = fan_in**-0.5
            nn.init.uniform_(weight, -bound, bound)
        for bias in (self.gate_up_proj_bias, self.down_proj_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def _project(
        self, name: str, rows: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        weight, bias = getattr(self, name), getattr(self, f"{name}_bias")
        if self.expert_parallel is not None:  # this rank's experts (DTensor Shard(0))
            weight = self.expert_parallel.local(weight)
            bias = None if bias is None else self.expert_parallel.local(bias)
        if weight.dim() == 2:  # packed (see ``unpack_weight``)
            assert self.unpack_weight is not None, f"{name} is packed without unpack_weight"
            out = _UnpackedGroupedLinear.apply(
                rows, weight, counts, self.unpack_weight, len(counts), self.grouped,
                self.transposed,
            )  # fmt: skip
        else:
            out = grouped_linear(
                rows, weight, counts, grouped=self.grouped, transposed=self.transposed
            )
        if name in self.lora and not self.lora[name].disabled:
            # Under expert parallelism the factors are FSDP2's (small, gathered whole); the
            # rows are for this process's experts only.
            here = slice(None) if self.expert_parallel is None else self.expert_parallel.experts
            out = out + self.lora[name].delta(rows, counts, self.grouped, here)
        return out if bias is None else out + bias[experts]

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        if self.swiglu_limit is not None:
            return clamped_swiglu(gate, up, self.swiglu_limit, self.swiglu_alpha)
        return self.activation(gate) * up

    def _experts(
        self, rows: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        # rows sorted by expert, counts per expert, each row's expert (for the biases).
        hidden = self._gate(self._project("gate_up_proj", rows, counts, experts))
        return self._project("down_proj", hidden, counts, experts)

    def forward(
        self, x: torch.Tensor, top_weights: torch.Tensor, top_indices: torch.Tensor
    ) -> torch.Tensor:
        """Apply each token's experts and sum their outputs weighted by the router.

        Args:
            x: ``[tokens, D]``.
            top_weights: ``[tokens, k]`` router weights (fp32 or ``x``'s dtype).
            top_indices: ``[tokens, k]`` expert of each weight.

        Returns:
            ``[tokens, D]`` in ``x``'s dtype.
        """
        num_tokens, top_k = top_indices.shape
        # Sort the (token, expert) pairs by expert once; every projection reuses the order.
        flat_experts = top_indices.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts)
        rows = x[order // top_k]
        if self.expert_parallel is None:
            out = self._experts(rows, counts, flat_experts[order])
        else:  # the rows travel to their experts' ranks and back
            out = self.expert_parallel.run(rows, counts, self._experts)
        out = out * top_weights.reshape(-1)[order, None]
        # Back to (token, slot) order, then the sum over each token's k experts.
        unsorted = torch.empty_like(out).index_copy(0, order, out)
        return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


class MoEBlock(nn.Module):
    """The sparse MoE feed-forward: ``gate`` (the router) and ``experts`` (HF's names).

    Args:
        dim: model dimension.
        intermediate_dim: each expert's hidden dimension.
        num_experts: number of experts.
        top_k: experts per token.
        normalize_top_k: renormalise the top-k router weights.
        activation: the experts' gate activation.
        weights_in_fp32: apply the router weights in fp32 and cast the sum (Mixtral); else
            cast them to the activations' dtype first (Qwen3-MoE). Equal in fp32.
        router_bias: a bias on the router (gpt-oss).
        **expert_options: ``MoEExperts``'s keyword options (``layout``, ``bias``,
            ``swiglu_limit``, ``swiglu_alpha``).
    """

    def __init__(
        self,
        dim: int,
        intermediate_dim: int,
        num_experts: int,
        top_k: int,
        *,
        normalize_top_k: bool,
        activation: str = "silu",
        weights_in_fp32: bool = False,
        router_bias: bool = False,
        **expert_options: Any,
    ) -> None:
        super().__init__()
        self.gate = MoERouter(dim, num_experts, bias=router_bias)
        self.experts = MoEExperts(
            dim, intermediate_dim, num_experts, activation=activation, **expert_options
        )
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.weights_in_fp32 = weights_in_fp32

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens ``[tokens, D]``: ``p = softmax(gate(x))`` in fp32, then the top k.

        The top-k weights ``p_j`` are renormalised to sum to 1 when ``normalize_top_k``
        (Mixtral and gpt-oss always, Qwen3-MoE's ``norm_topk_prob``): gpt-oss's softmax over
        the top-k logits is that, ``exp(l_j) / sum_top-k exp(l_i)``.

        Returns:
            ``(probabilities [tokens, E] fp32, top_weights [tokens, k] fp32,
            top_indices [tokens, k])``.
        """
        return self._route(self.gate(x))

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probabilities = F.softmax(logits.float(), dim=-1)
        top_weights, top_indices = torch.topk(probabilities, self.top_k, dim=-1)
        if self.normalize_top_k:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return probabilities, top_weights, top_indices

    def forward(self, x: torch.Tensor, router_stats: RouterStats | None = None) -> torch.Tensor:
        """Apply the block to ``x`` ``[..., D]``, recording router statistics if asked."""
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        probabilities, top_weights, top_indices = self._route(logits)
        if router_stats is not None:
            router_stats.add(probabilities, top_indices, logits)
        if not self.weights_in_fp32:
            top_weights = top_weights.to(x.dtype)
        return self.experts(flat, top_weights, top_indices).view_as(x)
