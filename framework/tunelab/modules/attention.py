"""Grouped-query self-attention with rotary embeddings."""

import torch
import torch.nn.functional as F
from torch import nn

from tunelab.modules.kv_cache import KVCache
from tunelab.modules.rotary import apply_rotary


class Attention(nn.Module):
    """Multi-head attention with ``num_kv_heads`` shared key/value heads (GQA).

    GQA: Ainslie et al., 2023, https://arxiv.org/abs/2305.13245. Each group of
    ``num_heads / num_kv_heads`` query heads shares one key/value head. Projection names match
    Hugging Face ``LlamaAttention`` (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) and the
    q/k feature order is HF's, so no rotary permutation is needed on import or export.

    Args:
        dim: model dimension.
        num_heads: query heads.
        num_kv_heads: key/value heads; divides ``num_heads``.
        head_dim: per-head feature size.
        qkv_bias: bias on the q/k/v projections (Qwen2).
        output_bias: bias on ``o_proj`` (Llama ``attention_bias`` sets both).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        output_bias: bool = False,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, "validated in ModelArgs"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=output_bias)
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend.

        Args:
            x: ``[batch, seq, dim]``.
            cos: rotary cosines ``[batch, seq, head_dim]``.
            sin: rotary sines ``[batch, seq, head_dim]``.
            mask: bool ``[batch, 1, seq, keys]`` (True = may attend), or None for causal.
                With a KV cache ``keys`` is the cache length and a mask is required.
            input_pos: cache slots ``[batch, seq]``; used only when a KV cache is set up.

        Returns:
            ``[batch, seq, dim]``.
        """
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if self.kv_cache is not None:
            assert input_pos is not None and mask is not None, "the decoder supplies both"
            k, v = self.kv_cache.update(input_pos, k, v)
        groups = self.num_heads // self.num_kv_heads
        if mask is None:
            # Causal with no mask tensor: the flash kernel handles GQA itself.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
        else:
            # The fused kernels that take a mask do not take GQA; expanding k/v keeps them usable.
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device))
        out = out.transpose(1, 2).reshape(batch, seq_len, self.num_heads * self.head_dim)
        return self.o_proj(out)
