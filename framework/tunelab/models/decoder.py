"""The decoder-only transformer shared by every supported family."""

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tunelab.distributed.context_parallel import ContextParallel
from tunelab.models.args import FULL, SLIDING, ModelArgs
from tunelab.models.families import adapter_for
from tunelab.models.state_dict_adapter import StateDictAdapter
from tunelab.modules import Attention, FeedForward, KVCache, RMSNorm, RotaryEmbedding
from tunelab.modules.attention import resolve_attention_backend
from tunelab.modules.masks import AttentionMask, causal_mask, positions_from_document_ids
from tunelab.modules.moe import MoEBlock, RouterStats
from tunelab.modules.shared_prefix import SharedPrefix


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``.

    With ``args.sandwich_norms`` (Gemma 2/3) the sub-layer outputs are normed too, under HF's
    names: ``h = x + post_attention_layernorm(attn(input_layernorm(x)))``, then
    ``out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``.

    In a mixture-of-experts layer (``args.is_moe_layer``) ``mlp`` is a ``MoEBlock``.

    Args:
        args: the model's arguments.
        layer_index: which layer this is (picks its attention kind).
    """

    def __init__(self, args: ModelArgs, layer_index: int = 0) -> None:
        super().__init__()
        softcap = args.attn_logit_softcap
        scale = args.query_pre_attn_scalar
        self.self_attn = Attention(
            args.dim,
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
            qkv_bias=args.qkv_bias,
            output_bias=args.output_bias,
            fused_qkv=args.fused_projections,
            qk_norm=args.qk_norm,
            norm_eps=args.norm_eps,
            norm_unit_offset=args.norm_unit_offset,
            scale=None if scale is None else scale**-0.5,
            softcap=softcap,
            sinks=args.attention_sinks,
        )
        self.mlp: FeedForward | MoEBlock
        if args.is_moe_layer(layer_index):
            self.mlp = MoEBlock(
                args.dim,
                args.moe_intermediate_dim,
                args.num_experts,
                args.num_experts_per_tok,
                normalize_top_k=args.norm_topk_prob,
                activation=args.hidden_act,
                weights_in_fp32=args.router_weights_in_fp32,
                router_bias=args.router_bias,
                layout=args.expert_layout,
                bias=args.expert_bias,
                swiglu_limit=args.swiglu_limit,
                swiglu_alpha=args.swiglu_alpha,
            )
        else:
            self.mlp = FeedForward(
                args.dim,
                args.intermediate_dim,
                bias=args.mlp_bias,
                activation=args.hidden_act,
                fused=args.fused_projections,
            )
        self.input_layernorm = self._norm(args)
        self.post_attention_layernorm = self._norm(args)
        self.sandwich_norms = args.sandwich_norms
        if args.sandwich_norms:
            self.pre_feedforward_layernorm = self._norm(args)
            self.post_feedforward_layernorm = self._norm(args)
        self.layer_type = args.layer_type(layer_index)

    @staticmethod
    def _norm(args: ModelArgs) -> RMSNorm:
        return RMSNorm(
            args.dim,
            eps=args.norm_eps,
            unit_offset=args.norm_unit_offset,
            scale_in_fp32=args.norm_scale_in_fp32,
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | AttentionMask | SharedPrefix | None = None,
        input_pos: torch.Tensor | None = None,
        router_stats: RouterStats | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Apply the block (see ``Attention.forward`` for the arguments).

        ``router_stats``, if given, records an MoE layer's routing (see ``RouterStats``).
        ``rows`` (long ``[rows]``, positions of ``[batch * seq]``, row-major): attention runs
        at every position (each query needs the keys and values of all of them), everything
        after it (``o_proj``, the residuals, the norms, the MLP) at these rows only, and the
        block returns ``[rows, dim]``: a last block whose other outputs nothing reads.
        """
        residual = x if rows is None else x.reshape(-1, x.shape[-1]).index_select(0, rows)
        attended = self.self_attn(self.input_layernorm(x), cos, sin, mask, input_pos, rows=rows)
        if self.sandwich_norms:
            h = residual + self.post_attention_layernorm(attended)
            mlp_out = self._mlp(self.pre_feedforward_layernorm(h), router_stats)
            return h + self.post_feedforward_layernorm(mlp_out)
        h = residual + attended
        return h + self._mlp(self.post_attention_layernorm(h), router_stats)

    def _mlp(self, normed: torch.Tensor, router_stats: RouterStats | None) -> torch.Tensor:
        # Every norm arrangement reaches the MLP here, so an MoE layer always records its routing.
        if isinstance(self.mlp, MoEBlock):
            return self.mlp(normed, router_stats)
        return self.mlp(normed)


class DecoderModel(nn.Module):
    """Embedding, blocks and final norm: HF's ``LlamaModel`` (the ``model.`` prefix)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.num_layers))
        self.norm = TransformerBlock._norm(args)
        self.rotary_emb = RotaryEmbedding(args.rotary_dim, args.rope_theta, args.rope_scaling)
        # Gemma 3's sliding-window layers rotate with their own base and no scaling.
        self.rotary_emb_local = (
            RotaryEmbedding(args.rotary_dim, args.rope_local_theta)
            if args.rope_local_theta is not None
            else None
        )


class TransformerDecoder(nn.Module):
    """A decoder LLM whose module tree mirrors ``transformers.LlamaForCausalLM``.

    Parameter names are HF keys (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``),
    so checkpoints, LoRA targets and FSDP wrapping all use the names users know.

    ``attention_backend`` (``auto``, ``sdpa``, ``flex`` or ``dense``; see
    ``tunelab.modules.attention``) picks the attention kernel of forwards given
    ``document_ids`` or no mask at all; an explicit ``mask`` tensor and KV-cache decoding always
    take the dense path.

    Args:
        args: the model's arguments.
    """

    # What an export's PEFT adapter declares: its task, and the whole modules it carries.
    peft_task_type = "CAUSAL_LM"
    modules_to_save: tuple[str, ...] = ()

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.attention_backend = "auto"
        # Whether training's forward may pass the loss's scored rows (``rows=``) to trim the
        # last layer past attention (``model.trim_last_layer``; set by ``build_model``).
        self.trim_last_layer = True
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

    def peft_module_path(self, native_key: str) -> str:
        """A parameter's name in transformers' model, as PEFT adapters name it (the same here)."""
        return native_key

    def peft_modules_to_save(self) -> list[str]:
        """The modules a LoRA export's adapter carries whole (PEFT's ``modules_to_save``).

        Here the heads of ``modules_to_save`` (a reward model's ``score``).
        """
        return list(self.modules_to_save)

    def hf_config_updates(self) -> dict[str, Any]:
        """What an export changes in the base model's ``config.json`` (nothing here)."""
        return {}

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

    def rope_recompute_position(self) -> int | None:
        """The position at which cached keys go stale, or None.

        LongRoPE picks its long factors once a position reaches
        ``original_max_position_embeddings``; keys cached before then were rotated with the
        short ones, so a generator re-encodes the sequence when it reaches that position.
        """
        scaling = self.args.rope_scaling or {}
        if scaling.get("rope_type") != "longrope":
            return None
        return int(scaling["original_max_position_embeddings"])

    def caches_are_enabled(self) -> bool:
        """Whether ``setup_caches`` is in effect."""
        return next(self._attentions()).kv_cache is not None

    # ---- forward --------------------------------------------------------------------------
    def _cache_reach(self, input_pos: torch.Tensor) -> int:
        """How many of the KV cache's first slots a cached forward at ``input_pos`` reads.

        A query at position ``p`` sees slots ``<= p``, so the slots past the largest position
        are masked for every query: on CPU in eager mode (where the maximum costs no device
        sync) the mask covers only the slots up to it, and attention reads only those (a
        decode step early in a completion reads a fraction of the cache). On other devices and
        under ``torch.compile`` (static shapes), the whole cache.
        """
        cache_len = next(self._attentions()).kv_cache.max_seq_len
        if input_pos.device.type != "cpu" or torch.compiler.is_compiling():
            return cache_len
        return min(cache_len, int(input_pos.max()) + 1)

    def _check_slots(self, input_pos: torch.Tensor) -> None:
        """Refuse positions past the KV cache (on CPU in eager mode, where it costs no sync).

        ``KVCache.update`` writes there through a flat index, which does not catch a slot
        past its row's end by itself.
        """
        cache = next(self._attentions()).kv_cache
        if cache is None or input_pos.device.type != "cpu" or torch.compiler.is_compiling():
            return
        cache_len = cache.max_seq_len
        if input_pos.numel() and int(input_pos.max()) >= cache_len:
            raise ValueError(
                f"input_pos reaches slot {int(input_pos.max())}, past the KV cache's "
                f"{cache_len} slots (setup_caches max_seq_len)"
            )

    def _prepare_mask(
        self, mask: torch.Tensor | None, input_pos: torch.Tensor, seq_len: int
    ) -> torch.Tensor | None:
        if mask is None and self.caches_are_enabled():
            slots = torch.arange(self._cache_reach(input_pos), device=input_pos.device)
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

    def _described_masks(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None,
        context: ContextParallel | None = None,
        last_keys: torch.Tensor | None = None,
    ) -> dict[str, AttentionMask]:
        """Each attention kind's ``AttentionMask`` (no dense tensor; kernels build their form).

        Under context parallelism the masks describe this rank's queries against the whole
        row, whose keys and values the layers gather. ``last_keys`` (``[batch, seq]``) lets
        queries see keys past themselves (``AttentionMask``; Gemma 3's image blocks).
        """
        batch, seq_len = tokens.shape
        backend = resolve_attention_backend(self.attention_backend, tokens.device)
        cp = {}
        if context is not None and context.enabled:
            seq_len *= context.size
            cp = {
                "query_positions": context.query_positions(seq_len, tokens.device),
                "gather_key_values": context.gather_key_values,
            }
        full = AttentionMask(
            batch, seq_len, tokens.device, backend, document_ids, last_keys=last_keys, **cp
        )
        masks = {FULL: full}
        if SLIDING in (self.args.layer_types or ()):
            masks[SLIDING] = full.with_window(self.args.sliding_window)
        explicit = self.args.attn_logit_softcap is not None or self.args.attention_sinks
        return {kind: mask.prepare(explicit) for kind, mask in masks.items()}

    def _layer_masks(
        self, mask: torch.Tensor | None, input_pos: torch.Tensor, seq_len: int
    ) -> dict[str, torch.Tensor | None]:
        """The mask of each attention kind: the given one, and that one cut to the window.

        A sliding-window query sees the keys at most ``sliding_window - 1`` positions back
        (itself included, transformers' rule). Without a cache, distances are row indices, so a
        packed row's document mask and the window combine correctly; with one, they are the
        query's position against the slot positions.
        """
        mask = self._prepare_mask(mask, input_pos, seq_len)
        masks = {FULL: mask}
        if SLIDING in (self.args.layer_types or ()):
            device = input_pos.device
            if self.caches_are_enabled():
                query = input_pos[:, None, :, None]
                keys = torch.arange(mask.shape[-1], device=device)  # the slots the mask covers
            else:
                query = torch.arange(seq_len, device=device)[:, None]
                keys = torch.arange(seq_len, device=device)
                if mask is None:
                    mask = causal_mask(seq_len, device)
            masks[SLIDING] = mask & (query - keys < self.args.sliding_window)
        return masks

    def _rotary_tables(
        self,
        input_pos: torch.Tensor,
        dtype: torch.dtype,
        context: ContextParallel | None = None,
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``(cos, sin)`` per attention kind (one table unless Gemma 3's local base differs).

        Under context parallelism LongRoPE picks its factors from the largest position of the
        whole rows (a max over the group), as the unsplit forward does.
        """
        max_position = None
        if context is not None and context.enabled and self.model.rotary_emb.longrope:
            max_position = context.max_over_group(input_pos.max())
        tables = {FULL: self.model.rotary_emb(input_pos, dtype, max_position)}
        local = self.model.rotary_emb_local
        tables[SLIDING] = tables[FULL] if local is None else local(input_pos, dtype)
        return tables

    def last_layer_rows(self, index: int, rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Layer ``index``'s ``rows`` keyword: ``rows`` for the last layer, else nothing.

        Only the last layer can compute its output at some positions only: every earlier one
        feeds the next layer's keys and values at all of them.
        """
        if rows is None or index != len(self.model.layers) - 1:
            return {}
        return {"rows": rows}

    def output(self, h: torch.Tensor) -> torch.Tensor:
        """The output layer: logits of final-normed hidden states ``[..., dim]``.

        ``lm_head``, then Gemma 2's final soft-cap ``cap * tanh(logits / cap)`` when configured.
        Losses that apply the output layer themselves, a chunk at a time, call this.

        Args:
            h: hidden states after ``model.norm``.

        Returns:
            Logits ``[..., vocab_size]``.
        """
        logits = self.lm_head(h)
        cap = self.args.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
        return_hidden: bool = False,
        router_stats: RouterStats | None = None,
        context_parallel: ContextParallel | None = None,
        shared_prefix: SharedPrefix | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            tokens: long ``[batch, seq]``.
            mask: bool ``[batch, seq, seq]`` or ``[batch, 1, seq, seq]``, True = may attend
                (see ``tunelab.modules.masks``); None means causal. With KV caches the key
                dimension is the cache length and None means causal over the cache (on CPU,
                over its slots up to the largest position only); a mask over fewer keys than
                the cache has makes attention read only those first slots (an incremental
                decoder passes the filled prefix).
            document_ids: integer ``[batch, seq]`` for packed rows, a document being a run of
                equal ids: causal attention within each document, with the kernel of
                ``attention_backend`` and no ``[seq, seq]`` tensor where the kernel needs none.
                ``input_pos`` defaults to positions restarting at each document. Not with
                ``mask`` or KV caches.
            input_pos: rotary positions ``[batch, seq]`` (restart per document when packing);
                None means ``0..seq-1``. Required with KV caches, where they are also the slots.
            return_hidden: Return the final normed hidden states ``[batch, seq, dim]``
                instead of the logits, for a loss that applies the output layer itself, one
                chunk at a time (``tunelab.losses.OutputLayer``).
            router_stats: a mixture-of-experts model records each MoE layer's routing in it,
                for the load-balancing loss (``RouterStats.loss()``); a dense one records
                nothing.
            context_parallel: context parallelism (``tunelab.distributed.ContextParallel``):
                ``tokens`` and ``input_pos`` (required: the global positions) are this rank's
                zig-zag slice of rows ``context_parallel.size`` times longer, and
                ``document_ids``, if given, are the whole rows (``ContextParallel.shard``
                makes such a batch). Attention gathers the keys and values of the row.
            shared_prefix: ``tokens`` is one packed row of distinct prompts then the
                completions that continue them (``tunelab.modules.SharedPrefix``), with
                ``input_pos`` their positions: each prompt is computed once. Not with ``mask``,
                ``document_ids``, KV caches, context parallelism or sliding-window layers.
            rows: long ``[rows]``, the positions of ``[batch * seq]`` (row-major) whose output
                is wanted (a loss's scored positions: ``tunelab.losses.scored_rows``). The last
                layer attends at every position as without it, then computes the rest of the
                layer (``o_proj``, residuals, norms, MLP), the final norm and the logits at
                these rows only (``last_layer_rows``); the result equals the full forward's
                rows. Not under tensor parallelism (whose ``o_proj`` splits the sequence).

        Returns:
            Logits ``[batch, seq, vocab_size]`` (hidden states with ``return_hidden``);
            ``[rows, ...]`` with ``rows``.

        Raises:
            ValueError: malformed tokens, mask or positions.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        batch, seq_len = tokens.shape
        described = mask is None and not self.caches_are_enabled()
        split = context_parallel is not None and context_parallel.enabled
        if split:
            if not described or input_pos is None:
                raise ValueError(
                    "context parallelism needs input_pos (global positions) and no mask or "
                    "KV caches"
                )
            row = (batch, seq_len * context_parallel.size)
            if document_ids is not None and tuple(document_ids.shape) != row:
                raise ValueError(
                    f"with context parallelism document_ids are whole rows {list(row)}, got "
                    f"shape {tuple(document_ids.shape)}"
                )
        elif document_ids is not None:
            if not described:
                raise ValueError("document_ids cannot be combined with a mask or KV caches")
            if document_ids.shape != tokens.shape:
                raise ValueError(
                    f"document_ids shape {tuple(document_ids.shape)} != tokens shape "
                    f"{tuple(tokens.shape)}"
                )
            if input_pos is None:
                input_pos = positions_from_document_ids(document_ids)
        if input_pos is None:
            if self.caches_are_enabled():
                raise ValueError("input_pos is required when KV caches are set up")
            input_pos = torch.arange(seq_len, device=tokens.device).expand(batch, seq_len)
        elif input_pos.shape != tokens.shape:
            raise ValueError(
                f"input_pos shape {tuple(input_pos.shape)} != tokens shape {tuple(tokens.shape)}"
            )
        if shared_prefix is not None:
            if (
                not described
                or split
                or document_ids is not None
                or SLIDING in (self.args.layer_types or ())
            ):
                raise ValueError(
                    "shared_prefix takes no mask, document_ids, KV caches, context parallelism "
                    "or sliding-window layers"
                )
            masks = {FULL: shared_prefix}
        elif described:
            masks = self._described_masks(tokens, document_ids, context_parallel)
        else:
            self._check_slots(input_pos)
            masks = self._layer_masks(mask, input_pos, seq_len)
        h = self.model.embed_tokens(tokens)
        if self.args.embed_scale:
            # Gemma: sqrt(dim) rounded to the activations' dtype first, as transformers does.
            h = h * torch.tensor(self.args.dim**0.5, dtype=h.dtype, device=h.device)
        rotary = self._rotary_tables(input_pos, h.dtype, context_parallel)
        routing = {} if router_stats is None else {"router_stats": router_stats}
        for index, layer in enumerate(self.model.layers):
            kind = self.args.layer_type(index)
            cos, sin = rotary[kind]
            last = self.last_layer_rows(index, rows)
            h = layer(h, cos, sin, masks[kind], input_pos, **routing, **last)
        h = self.model.norm(h)
        if return_hidden:
            return h
        return self.output(h)
