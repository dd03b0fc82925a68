"""Grouped-query self-attention with rotary embeddings, and the choice of attention kernel.

Backends (``attention_backend``), for attention described by an ``AttentionMask``:

- ``sdpa``: ``scaled_dot_product_attention`` with ``enable_gqa`` (no K/V repeat); plain
  causal rows take ``is_causal`` and no mask at all, packed or sliding-window rows a dense bool
  mask built once per forward.
- ``flex``: ``flex_attention`` with a ``BlockMask`` built from the document intervals (no
  ``[seq, seq]`` tensor), the sliding window in the same mask and Gemma 2's soft-cap as a
  ``score_mod``; compiled on CUDA. torch 2.13 has no FlexAttention backward on CPU, and its
  eager CPU forward is several times slower than ``sdpa`` (TORCH_NOTES.md, issue 17).
- ``dense``: the pre-issue-17 path, kept as the baseline: a dense mask and K/V heads repeated.
- ``auto``: ``flex`` on CUDA, ``sdpa`` elsewhere.

Plain causal rows without soft-capping take SDPA's ``is_causal`` under ``sdpa`` and ``flex``.

Attention sinks (gpt-oss, ``sinks=True``): a learned logit ``s_h`` per head joins every
softmax's denominator, ``p_j = exp(x_j) / (exp(s_h) + sum_i exp(x_i))`` (Xiao et al., 2023,
https://arxiv.org/abs/2309.17453, with the sink a parameter rather than a token). Each kernel
adds it its own way: ``dense`` in its explicit scores, ``sdpa`` as one more key column (a
zero key and value whose float-mask entry is ``s_h``), ``flex`` by rescaling its output with
the log-sum-exp it returns, ``out * sigmoid(lse - s_h)``, which is the same quotient.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tunelab.modules import packed_linear
from tunelab.modules.kv_cache import KVCache
from tunelab.modules.masks import AttentionMask
from tunelab.modules.norm import RMSNorm
from tunelab.modules.rotary import apply_rotary
from tunelab.modules.shared_prefix import SharedPrefix

ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "dense")
"""The values of ``attention_backend``."""


def resolve_attention_backend(backend: str, device: torch.device | str) -> str:
    """The backend ``backend`` means on ``device``: ``auto`` becomes ``flex`` or ``sdpa``.

    Args:
        backend: one of ``ATTENTION_BACKENDS``.
        device: where attention runs.

    Returns:
        ``sdpa``, ``flex`` or ``dense``.

    Raises:
        ValueError: an unknown backend.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    return backend


_compiled_flex: dict[str, Callable] = {}


def _flex_kernel(device: torch.device) -> Callable:
    """``flex_attention``, compiled on CUDA (eager elsewhere: CPU flex has no backward).

    Compiled with torch's default dynamic-shape policy: the first sequence length compiles a
    static kernel, a second one recompiles with dynamic lengths, so variable-length batches do
    not compile once per length.
    """
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _compiled_flex:
        _compiled_flex["cuda"] = torch.compile(flex_attention)
    return _compiled_flex["cuda"]


def folded_gqa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """GQA under a bool mask with one plain SDPA call and no K/V repeat.

    Each K/V head's query group is folded into the query length: ``q`` ``[batch, heads,
    seq, d]`` becomes ``[batch, kv_heads, groups * seq, d]`` (query head ``h`` uses K/V head
    ``h // groups``, so this is a view) and the mask is repeated over the group (bools).

    Args:
        q: ``[batch, heads, seq, head_dim]``.
        k: ``[batch, kv_heads, keys, head_dim]``.
        v: same shape as ``k``.
        mask: bool ``[batch or 1, 1, seq, keys]``, True = may attend.
        scale: score scale (None: ``head_dim ** -0.5``).

    Returns:
        ``[batch, heads, seq, head_dim]``.
    """
    batch, heads, seq_len, head_dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    folded = q.reshape(batch, kv_heads, groups * seq_len, head_dim)
    mask = mask.expand(batch, 1, seq_len, keys)[:, :, None]
    mask = mask.expand(batch, 1, groups, seq_len, keys).reshape(batch, 1, groups * seq_len, keys)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
    return out.view(batch, heads, seq_len, head_dim)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One query token per row against its cached keys, from explicit scores (fp32, CPU).

    ``softmax(mask(q k^T * scale)) v`` with two batched matmuls and one masked softmax over
    the keys: at a decode step's single query per row this is 2x faster than CPU's SDPA
    kernel (measured at the GRPO bench's 32 rows x 64 slots, 12/4 heads x 64: 0.4 against
    0.9 ms), whose blocked online softmax is built for many queries. GQA without repeating
    K/V: the ``groups = heads / kv_heads`` query heads that share a K/V head (head ``h``
    uses K/V head ``h // groups``) are that head's ``groups`` query rows, ``[batch, kv_heads,
    groups, head_dim]`` (a view of ``q``), so each cached key is read once per K/V head.

    Args:
        q: ``[batch, heads, 1, head_dim]``.
        k: ``[batch, kv_heads, keys, head_dim]`` (``heads`` a multiple of ``kv_heads``).
        v: same shape as ``k``.
        mask: bool ``[batch or 1, 1, 1, keys]``, True = may attend; every row attends to at
            least one key (its own slot).
        scale: score scale (None: ``head_dim ** -0.5``).

    Returns:
        ``[batch, heads, 1, head_dim]``.
    """
    batch, heads, _, head_dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    # ``torch.matmul`` of these 4-d tensors folds them into the same 3-d ``bmm`` operands
    # (views of the cache: its first two dims merge); calling ``bmm`` on them directly skips
    # its expands and reshapes, not a bit of the result.
    grouped = q.reshape(batch * kv_heads, heads // kv_heads, head_dim)
    scores = torch.bmm(grouped, k.reshape(batch * kv_heads, keys, head_dim).transpose(1, 2))
    scores = scores.mul_(scale).view(batch, kv_heads, -1, keys)
    scores = scores.masked_fill_(~mask, float("-inf")).view(batch * kv_heads, -1, keys)
    weights = torch.softmax(scores, dim=-1)
    out = torch.bmm(weights, v.reshape(batch * kv_heads, keys, head_dim))
    return out.view(batch, heads, 1, head_dim)


class Attention(nn.Module):
    """Multi-head attention with ``num_kv_heads`` shared key/value heads (GQA).

    GQA: Ainslie et al., 2023, https://arxiv.org/abs/2305.13245. Each group of
    ``num_heads / num_kv_heads`` query heads shares one key/value head. Projection names match
    Hugging Face ``LlamaAttention`` (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) and the
    q/k feature order is HF's, so no rotary permutation is needed on import or export.

    Family options: ``fused_qkv`` (Phi-3) keeps one ``qkv_proj`` whose output is split into
    q, k, v; ``qk_norm`` (Qwen3, Gemma 3) adds ``q_norm``/``k_norm``, an RMSNorm over each head
    before rotary; ``scale`` replaces ``head_dim ** -0.5`` (Gemma's ``query_pre_attn_scalar``);
    ``softcap`` (Gemma 2) bounds the scores, ``cap * tanh(scores / cap)``, before the mask.
    Scores are needed for that, so soft-capped attention runs an explicit fp32-softmax path;
    everything else runs ``scaled_dot_product_attention``.

    Args:
        dim: model dimension.
        num_heads: query heads.
        num_kv_heads: key/value heads; divides ``num_heads``.
        head_dim: per-head feature size.
        qkv_bias: bias on the q/k/v projections (Qwen2).
        output_bias: bias on ``o_proj`` (Llama ``attention_bias`` sets both).
        fused_qkv: one ``qkv_proj`` module (Phi-3).
        qk_norm: RMSNorm each query and key head (Qwen3, Gemma 3).
        norm_eps: epsilon of those norms.
        norm_unit_offset: those norms scale by ``1 + weight`` (Gemma).
        scale: score scale; None means ``head_dim ** -0.5``.
        softcap: attention logit soft-cap; None for none.
        sinks: a learned sink logit per head, ``sinks`` ``[num_heads]`` (gpt-oss).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        output_bias: bool = False,
        *,
        fused_qkv: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        norm_unit_offset: bool = False,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, "validated in ModelArgs"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.softcap = softcap
        self.split_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        if fused_qkv:
            self.qkv_proj = nn.Linear(dim, sum(self.split_sizes), bias=qkv_bias)
        else:
            self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=qkv_bias)
            self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=qkv_bias)
            self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=output_bias)
        self.fused_qkv = fused_qkv
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=norm_eps, unit_offset=norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps, unit_offset=norm_unit_offset)
        self.qk_norm = qk_norm
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.kv_cache: KVCache | None = None
        self.packed_projection: packed_linear.PackedProjection | None = None
        """Set only inside ``packed_linears``: q, k and v as one packed matrix."""

    def sibling_projections(self) -> list[nn.Module]:
        """The projections of one input that ``packed_linears`` may run as one matmul."""
        return [] if self.fused_qkv else [self.q_proj, self.k_proj, self.v_proj]

    @property
    def explicit_scores(self) -> bool:
        """Whether plain causal rows need a mask too (soft-capped scores or sinks)."""
        return self.softcap is not None or self.sinks is not None

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as ``[batch, seq, heads, head_dim]`` (q/k normed when ``qk_norm``)."""
        batch, seq_len, _ = x.shape
        if self.packed_projection is not None:
            q, k, v = self.packed_projection(x)
        elif self.fused_qkv:
            qkv = self.qkv_proj(x)
            # Under tensor parallelism this rank computes its slice of each part.
            width, total = qkv.shape[-1], sum(self.split_sizes)
            q, k, v = qkv.split([size * width // total for size in self.split_sizes], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # -1: under tensor parallelism this rank computes num_heads / N of the heads.
        q = q.view(batch, seq_len, -1, self.head_dim)
        k = k.view(batch, seq_len, -1, self.head_dim)
        v = v.view(batch, seq_len, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | AttentionMask | SharedPrefix | None = None,
        input_pos: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend.

        Args:
            x: ``[batch, seq, dim]``.
            cos: rotary cosines ``[batch, seq, rotary_dim]``.
            sin: rotary sines ``[batch, seq, rotary_dim]``.
            mask: an ``AttentionMask`` (the kernel follows its backend), a ``SharedPrefix``
                (rows sharing their prompts, packed in one row), or a bool
                ``[batch, 1, seq, keys]`` (True = may attend), or None for causal. With a KV
                cache a bool mask is required; its ``keys`` is the cache length, or fewer: then
                only the cache's first ``keys`` slots are read (a decoder that knows no query
                sees past them skips the rest).
            input_pos: cache slots ``[batch, seq]``; used only when a KV cache is set up.
            rows: long ``[rows]``, positions of ``[batch * seq]`` (row-major): every position
                attends as without it, and only these rows go through ``o_proj``.

        Returns:
            ``[batch, seq, dim]``, or ``[rows, dim]`` with ``rows``.
        """
        batch, seq_len, _ = x.shape
        if self.packed_projection is not None and not self.qk_norm:
            q, k, v = self._project_rotated(x, cos, sin)
        else:
            q, k, v = (t.transpose(1, 2) for t in self._project(x))
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        if self.kv_cache is not None:
            assert input_pos is not None and mask is not None, "the decoder supplies both"
            k, v = self.kv_cache.update(input_pos, k, v)
            if isinstance(mask, torch.Tensor) and mask.shape[-1] < k.shape[2]:
                # A mask over the cache's first slots only (the filled ones): read just those.
                k, v = k[:, :, : mask.shape[-1]], v[:, :, : mask.shape[-1]]
        if self.kv_cache is not None and self._decodes_explicitly(q, mask):
            out = decode_attention(q, k, v, mask, scale=self.scale)
        elif isinstance(mask, SharedPrefix):
            out = self._attend_shared_prefix(q, k, v, mask)
        elif isinstance(mask, AttentionMask):
            out = self._attend_described(q, k, v, mask)
        elif self.kv_cache is not None and self.num_heads != self.num_kv_heads:
            out = self._attend_masked_gqa(q, k, v, mask)
        else:
            out = self._attend(q, k, v, mask)
        out = out.transpose(1, 2).reshape(batch, seq_len, -1)
        if rows is not None:
            out = out.reshape(batch * seq_len, -1).index_select(0, rows)
        return self.o_proj(out)

    def _project_rotated(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rotated q and k, and v, ``[batch, heads, seq, head_dim]``, from one packed matmul.

        q's and k's heads are adjacent in its output, so one rotary call turns both: each
        element goes through the same operations as in two calls, to the same bits.
        """
        batch, seq_len, _ = x.shape
        projection = self.packed_projection
        out = packed_linear.linear(x, projection.weight, projection.bias)
        q_features, k_features, _ = projection.sizes
        qk = out[..., : q_features + k_features].view(batch, seq_len, -1, self.head_dim)
        qk = apply_rotary(qk, cos, sin, head_axis=2)
        q_heads = q_features // self.head_dim
        q, k = qk[:, :, :q_heads], qk[:, :, q_heads:]
        v = out[..., q_features + k_features :].view(batch, seq_len, -1, self.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _decodes_explicitly(self, q: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether a cached forward runs :func:`decode_attention`.

        One query per row, fp32 on CPU, a bool mask, plain scores (soft-capped scores and
        sinks take their own path). Prefills (several queries) and other devices keep SDPA.
        """
        return (
            q.shape[2] == 1
            and q.device.type == "cpu"
            and q.dtype == torch.float32
            and isinstance(mask, torch.Tensor)
            and not self.explicit_scores
        )

    def _attend_shared_prefix(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SharedPrefix
    ) -> torch.Tensor:
        """Rows sharing prompts (``tunelab.modules.shared_prefix``), ``[1, heads, T, d]``.

        Prompts attend causally; each completion over its prompt's keys and its own.
        """
        q_prompts, q_rows = layout.split(q)
        k_prompts, k_rows = layout.split(k)
        v_prompts, v_rows = layout.split(v)
        prompts = self._attend(q_prompts, k_prompts, v_prompts, None)
        keys = layout.completion_keys(k_prompts, k_rows)
        values = layout.completion_keys(v_prompts, v_rows)
        mask = layout.completion_mask()
        if self.num_heads != self.num_kv_heads:
            rows = self._attend_masked_gqa(q_rows, keys, values, mask)
        else:
            rows = self._attend(q_rows, keys, values, mask)
        return layout.join(prompts, rows)

    def _attend_masked_gqa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """GQA under a bool mask (the KV cache's, a shared prompt's), K/V heads not repeated.

        CPU's SDPA takes a mask and ``enable_gqa`` together (its forward bit-equal to
        repeating K/V: test_attention_kernels). Elsewhere a mask with GQA falls back to the
        math kernel, so each K/V head's query group is folded into the query length instead:
        ``[batch, heads, seq, d]`` becomes ``[batch, kv_heads, groups * seq, d]`` (head
        ``h`` serves K/V head ``h // groups``, so this is a view) and one plain SDPA call
        reads each cached key once per group. Soft-capped scores and sinks take the explicit
        path (K/V repeated).
        """
        if self.explicit_scores:
            return self._attend(q, k, v, mask)
        if q.device.type == "cpu":
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True, scale=self.scale
            )
        return folded_gqa_attention(q, k, v, mask, scale=self.scale)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention under a dense bool mask, or causal when None (the ``dense`` path)."""
        groups = self.num_heads // self.num_kv_heads
        if mask is None and not self.explicit_scores:
            # Causal with no mask tensor: the flash kernel handles GQA itself.
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=groups > 1, scale=self.scale
            )
        # The fused kernels that take a mask do not take GQA; expanding k/v keeps them usable.
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if mask is None:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        if not self.explicit_scores:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask.to(q.device), scale=self.scale
            )
        return self._explicit(q, k, v, mask.to(q.device))

    def _attend_described(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """Attention under an ``AttentionMask``, with the kernel of its backend.

        Under context parallelism (``mask.gather_key_values``) this rank's queries attend to
        the whole row's keys and values, gathered here (after rotary, with global positions).
        """
        if mask.gather_key_values is not None:
            k, v = mask.gather_key_values(k, v)
        if mask.backend != "dense":
            if mask.causal_only and not self.explicit_scores:
                return self._attend(q, k, v, None)
            if mask.backend == "flex":
                return self._flex(q, k, v, mask)
            if self.sinks is not None and self.softcap is None:
                return self._sdpa_with_sinks(q, k, v, mask.dense())
            if self.softcap is None:
                return F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=mask.dense(),
                    enable_gqa=self.num_heads != self.num_kv_heads,
                    scale=self.scale,
                )
        return self._attend(q, k, v, mask.dense())

    def _flex(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """``flex_attention`` over ``mask``'s ``BlockMask``, soft-capped by a ``score_mod``."""
        if q.device.type == "cpu" and q.requires_grad:
            raise ValueError(
                "attention_backend 'flex' cannot train on CPU: torch has no FlexAttention "
                "backward on CPU (use 'sdpa' or 'auto')"
            )
        score_mod = None
        if self.softcap is not None:
            cap = self.softcap

            def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 (flex's)
                return torch.tanh(score / cap) * cap

        kernel = _flex_kernel(q.device)
        options = dict(
            score_mod=score_mod,
            block_mask=mask.block_mask(),
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        if self.sinks is None:
            return kernel(q, k, v, **options)
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = kernel(q, k, v, **options, return_aux=AuxRequest(lse=True))
        # exp(lse) / (exp(lse) + exp(sink)): the share of the mass the sink leaves the keys.
        kept = torch.sigmoid(aux.lse.float() - self.sinks.float()[None, :, None])
        return (out.float() * kept[..., None]).to(q.dtype)

    def _sdpa_with_sinks(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """SDPA with each head's sink as one more key.

        The extra key and value are zeros; a float mask sets its score to ``s_h`` (``0``
        where ``allowed``, ``-inf`` elsewhere): ``[batch, heads, seq, keys + 1]``.
        """
        batch, heads, seq_len, _ = q.shape
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~allowed, float("-inf")).expand(batch, heads, seq_len, -1)
        sink = self.sinks.to(q.dtype).view(1, heads, 1, 1).expand(batch, heads, seq_len, 1)
        zeros = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
        return F.scaled_dot_product_attention(
            q,
            torch.cat([k, zeros], dim=2),
            torch.cat([v, zeros], dim=2),
            attn_mask=torch.cat([bias, sink], dim=-1),
            enable_gqa=self.num_heads != self.num_kv_heads,
            scale=self.scale,
        )

    def _explicit(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """``softmax(mask(scores)) v`` from explicit scores, the softmax in fp32.

        ``scores = q k^T * scale``, soft-capped ``cap * tanh(scores / cap)`` when ``softcap``
        (Gemma 2, https://arxiv.org/abs/2408.00118), and with each head's sink logit as one
        more column of the softmax, dropped after it, when ``sinks`` (gpt-oss). The score
        matrix is materialised, so this path costs ``O(seq^2)`` memory per head.
        """
        scale = self.scale if self.scale is not None else self.head_dim**-0.5
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is not None:
            batch, heads, seq_len, _ = scores.shape
            sink = self.sinks.to(scores.dtype).view(1, heads, 1, 1)
            scores = torch.cat([scores, sink.expand(batch, heads, seq_len, 1)], dim=-1)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        if self.sinks is not None:
            weights = weights[..., :-1]
        return torch.matmul(weights, v)
