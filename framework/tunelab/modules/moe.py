"""Mixture-of-experts feed-forward: a top-k router and experts run as grouped matmuls.

Each token goes to the ``top_k`` experts of highest router probability (Shazeer et al., 2017,
https://arxiv.org/abs/1701.06538; Mixtral, https://arxiv.org/abs/2401.04088) and its output is
``sum_j w_j * expert_j(x)``. The experts' weights are stacked, ``gate_up_proj`` ``[E, 2I, D]``
(gate rows first) and ``down_proj`` ``[E, D, I]``, as transformers 5 holds them. The
(token, expert) pairs are sorted by expert once per layer, and each projection is one grouped
matmul over the sorted rows (``torch.nn.functional.grouped_mm`` where the device and dtype
have a kernel, else one padded ``bmm``): no Python loop over experts, and no capacity limit
(no token is ever dropped).

The router's load-balancing loss (Switch Transformer, Fedus et al., 2021,
https://arxiv.org/abs/2101.03961, eq. 4-6) is gathered across layers by ``RouterStats``, the
way transformers' ``load_balancing_loss_func`` computes it.
"""

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
    rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, *, grouped: bool | None = None
) -> torch.Tensor:
    """``rows[i] @ weight[g(i)].T`` for rows sorted by group: one grouped matmul.

    Args:
        rows: ``[S, in]``, sorted so group ``g``'s rows are contiguous and in group order.
        weight: ``[G, out, in]``, one matrix per group (a ``nn.Linear`` weight each).
        counts: int ``[G]``, rows per group (summing to ``S``; zeros allowed).
        grouped: use ``grouped_mm`` (True) or the padded ``bmm`` (False); None picks
            ``grouped_mm`` where it has a kernel.

    Returns:
        ``[S, out]``.
    """
    if grouped is None:
        grouped = _grouped_mm_available(rows, weight)
    if grouped:
        function = getattr(F, "grouped_mm", None) or torch._grouped_mm
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return function(rows, weight.transpose(-2, -1), offs=offsets)
    return _padded_bmm(rows, weight, counts)


def _padded_bmm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``grouped_linear`` as one ``bmm`` over groups padded to the largest group."""
    num_groups = weight.shape[0]
    starts = torch.cumsum(counts, dim=0) - counts
    group_of_row = torch.repeat_interleave(torch.arange(num_groups, device=rows.device), counts)
    slot = torch.arange(rows.shape[0], device=rows.device) - starts[group_of_row]
    width = int(counts.max()) if rows.shape[0] else 0
    padded = rows.new_zeros(num_groups, width, rows.shape[1])
    padded = padded.index_put((group_of_row, slot), rows)
    out = torch.bmm(padded, weight.transpose(-2, -1))
    return out[group_of_row, slot]


class RouterStats:
    """Gathers the router statistics of one forward for the load-balancing loss.

    ``loss = E * sum_e f_e * P_e`` (Switch Transformer eq. 4), where over all MoE layers and
    counted tokens ``f_e`` is the fraction of top-k assignments that went to expert ``e`` (the
    ``f_e`` sum to ``top_k``) and ``P_e`` the mean router probability of ``e``. Sums are
    taken over layers first and divided once, exactly as transformers'
    ``load_balancing_loss_func``; ``valid`` plays its ``attention_mask``: padding tokens are not
    counted, and the tokens of packed documents all are.

    Pass one to ``TransformerDecoder.forward(router_stats=...)``, then read ``loss()``.

    Args:
        valid: bool or 0/1 ``[batch, seq]``, the tokens to count; None counts every token.
    """

    def __init__(self, valid: torch.Tensor | None = None) -> None:
        self.valid = valid
        self.num_experts = 0
        self.num_layers = 0
        self._assigned: torch.Tensor | None = None
        self._probabilities: torch.Tensor | None = None
        self._rows: torch.Tensor | float = 0.0

    def add(self, probabilities: torch.Tensor, top_indices: torch.Tensor) -> None:
        """Record one MoE layer.

        Args:
            probabilities: fp32 ``[tokens, E]`` router softmax, tokens in ``[batch, seq]``
                order (gradients flow through it into the router).
            top_indices: long ``[tokens, top_k]``, the experts each token went to.
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

    def loss(self) -> torch.Tensor:
        """The load-balancing loss (before ``router_aux_loss_coef``); 0 with no MoE layer.

        Returns:
            A scalar fp32 tensor.
        """
        if self._assigned is None:
            return torch.zeros(())
        fraction = self._assigned / self._rows
        probability = self._probabilities / self._rows
        return (fraction * probability).sum() * self.num_experts


class MoERouter(nn.Linear):
    """The router's linear layer, ``weight`` ``[E, D]`` (HF's ``mlp.gate.weight``).

    A plain ``nn.Linear`` that LoRA can target by name (``gate``), but which ``all-linear``
    leaves out and QLoRA keeps in the training dtype: its few weights decide the routing.
    ``MoEBlock.route`` turns its logits into each token's experts.

    Args:
        dim: model dimension.
        num_experts: experts to choose from.
    """

    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__(dim, num_experts, bias=False)


class MoEExperts(nn.Module):
    """``E`` gated MLPs with stacked weights, run as grouped matmuls.

    Expert ``e`` computes ``down_proj[e] @ (act(gate) * up)`` with
    ``gate, up = split(gate_up_proj[e] @ x)``, HF's ``Qwen3MoeExperts``/``MixtralExperts``.

    Args:
        dim: model dimension.
        intermediate_dim: each expert's hidden dimension.
        num_experts: number of experts.
        activation: the gate's activation, a key of ``ACTIVATIONS``.
    """

    def __init__(
        self, dim: int, intermediate_dim: int, num_experts: int, *, activation: str = "silu"
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_dim = intermediate_dim
        self.activation = ACTIVATIONS[activation]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, intermediate_dim))
        self.grouped: bool | None = None
        """``grouped_linear``'s choice: None picks ``grouped_mm`` where it has a kernel."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise each expert's matrices as ``nn.Linear`` would."""
        for weight in (self.gate_up_proj, self.down_proj):
            bound = weight.shape[-1] ** -0.5
            nn.init.uniform_(weight, -bound, bound)

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
        gate, up = grouped_linear(rows, self.gate_up_proj, counts, grouped=self.grouped).chunk(
            2, dim=-1
        )
        out = grouped_linear(
            self.activation(gate) * up, self.down_proj, counts, grouped=self.grouped
        )
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
    ) -> None:
        super().__init__()
        self.gate = MoERouter(dim, num_experts)
        self.experts = MoEExperts(dim, intermediate_dim, num_experts, activation=activation)
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.weights_in_fp32 = weights_in_fp32

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens ``[tokens, D]``: ``p = softmax(gate(x))`` in fp32, then the top k.

        The top-k weights ``p_j`` are renormalised to sum to 1 when ``normalize_top_k``
        (Mixtral always, Qwen3-MoE's ``norm_topk_prob``).

        Returns:
            ``(probabilities [tokens, E] fp32, top_weights [tokens, k] fp32,
            top_indices [tokens, k])``.
        """
        probabilities = F.softmax(self.gate(x).float(), dim=-1)
        top_weights, top_indices = torch.topk(probabilities, self.top_k, dim=-1)
        if self.normalize_top_k:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return probabilities, top_weights, top_indices

    def forward(self, x: torch.Tensor, router_stats: RouterStats | None = None) -> torch.Tensor:
        """Apply the block to ``x`` ``[..., D]``, recording router statistics if asked."""
        flat = x.reshape(-1, x.shape[-1])
        probabilities, top_weights, top_indices = self.route(flat)
        if router_stats is not None:
            router_stats.add(probabilities, top_indices)
        if not self.weights_in_fp32:
            top_weights = top_weights.to(x.dtype)
        return self.experts(flat, top_weights, top_indices).view_as(x)
