"""The decoder-only transformer shared by every supported family."""

from collections.abc import Iterator

import torch
from torch import nn

from tunelab.models.args import ModelArgs
from tunelab.models.families import adapter_for
from tunelab.models.state_dict_adapter import StateDictAdapter
from tunelab.modules import Attention, FeedForward, KVCache, RMSNorm, RotaryEmbedding


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``.

    Args:
        args: the model's arguments.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(
            args.dim,
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
            qkv_bias=args.qkv_bias,
            output_bias=args.output_bias,
        )
        self.mlp = FeedForward(args.dim, args.intermediate_dim, bias=args.mlp_bias)
        self.input_layernorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Apply the block (see ``Attention.forward`` for the arguments)."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, input_pos)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """Embedding, blocks and final norm: HF's ``LlamaModel`` (the ``model.`` prefix)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling)


class TransformerDecoder(nn.Module):
    """A decoder LLM whose module tree mirrors ``transformers.LlamaForCausalLM``.

    Parameter names are HF keys (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``),
    so checkpoints, LoRA targets and FSDP wrapping all use the names users know.

    Args:
        args: the model's arguments.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderModel(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()

    @property
    def layers(self) -> nn.ModuleList:
        """The transformer blocks, in order (the units to FSDP-wrap and checkpoint)."""
        return self.model.layers

    @property
    def state_dict_adapter(self) -> StateDictAdapter:
        """This family's mapping between native and HF state dicts."""
        return adapter_for(self.args)

    def tie_weights(self) -> None:
        """Make ``lm_head`` share the embedding's weight when the config ties them.

        ``to_empty`` and ``load_state_dict(assign=True)`` replace parameters one module at a time
        and so break sharing; call this after either.
        """
        embedding = self.model.embed_tokens.weight
        if self.args.tie_embeddings and self.lm_head.weight is not embedding:
            self.lm_head.weight = embedding

    def to_empty(
        self, *, device: torch.device | str | None, recurse: bool = True
    ) -> "TransformerDecoder":
        """``nn.Module.to_empty``, then ``tie_weights`` (plain tensors lose their sharing)."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    # ---- KV cache -------------------------------------------------------------------------
    def _attentions(self) -> Iterator[Attention]:
        return (layer.self_attn for layer in self.model.layers)

    def setup_caches(
        self,
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Allocate a KV cache in every block, for incremental decoding.

        Args:
            batch_size: rows decoded together.
            max_seq_len: prompt plus generated tokens.
            dtype: cache dtype; defaults to the embedding's.
            device: cache device; defaults to the embedding's.
        """
        weight = self.model.embed_tokens.weight
        for attention in self._attentions():
            attention.kv_cache = KVCache(
                batch_size,
                self.args.num_kv_heads,
                max_seq_len,
                self.args.head_dim,
                dtype=dtype or weight.dtype,
                device=device or weight.device,
            )

    def reset_caches(self) -> None:
        """Clear every KV cache (start a new sequence)."""
        for attention in self._attentions():
            if attention.kv_cache is not None:
                attention.kv_cache.reset()

    def teardown_caches(self) -> None:
        """Free the KV caches; the model goes back to full-sequence forwards."""
        for attention in self._attentions():
            attention.kv_cache = None

    def caches_are_enabled(self) -> bool:
        """Whether ``setup_caches`` is in effect."""
        return next(self._attentions()).kv_cache is not None

    # ---- forward --------------------------------------------------------------------------
    def _prepare_mask(
        self, mask: torch.Tensor | None, input_pos: torch.Tensor, seq_len: int
    ) -> torch.Tensor | None:
        if mask is None and self.caches_are_enabled():
            cache_len = next(self._attentions()).kv_cache.max_seq_len
            slots = torch.arange(cache_len, device=input_pos.device)
            mask = slots[None, None, :] <= input_pos[:, :, None]
        if mask is None:
            return None
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor (True = may attend), got {mask.dtype}")
        if mask.dim() == 3:
            mask = mask[:, None]
        if mask.dim() != 4 or mask.shape[2] != seq_len:
            raise ValueError(
                f"mask must be [batch, seq, keys] or [batch, 1, seq, keys] with seq={seq_len}, "
                f"got shape {tuple(mask.shape)}"
            )
        return mask

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            tokens: long ``[batch, seq]``.
            mask: bool ``[batch, seq, seq]`` or ``[batch, 1, seq, seq]``, True = may attend
                (see ``tunelab.modules.masks``); None means causal. With KV caches the key
                dimension is the cache length and None means causal over the cache.
            input_pos: rotary positions ``[batch, seq]`` (restart per document when packing);
                None means ``0..seq-1``. Required with KV caches, where they are also the slots.

        Returns:
            Logits ``[batch, seq, vocab_size]``.

        Raises:
            ValueError: malformed tokens, mask or positions.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        batch, seq_len = tokens.shape
        if input_pos is None:
            if self.caches_are_enabled():
                raise ValueError("input_pos is required when KV caches are set up")
            input_pos = torch.arange(seq_len, device=tokens.device).expand(batch, seq_len)
        elif input_pos.shape != tokens.shape:
            raise ValueError(
                f"input_pos shape {tuple(input_pos.shape)} != tokens shape {tuple(tokens.shape)}"
            )
        mask = self._prepare_mask(mask, input_pos, seq_len)
        h = self.model.embed_tokens(tokens)
        cos, sin = self.model.rotary_emb(input_pos, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, mask, input_pos)
        return self.lm_head(self.model.norm(h))
