"""Transformer building blocks: attention, feed-forward, norms, rotary embeddings, masks."""

from tunelab.modules.attention import Attention
from tunelab.modules.feed_forward import FeedForward
from tunelab.modules.kv_cache import KVCache
from tunelab.modules.masks import (
    AttentionMask,
    causal_mask,
    document_causal_mask,
    padding_mask,
    positions_from_document_ids,
)
from tunelab.modules.moe import MoEBlock, MoEExperts, MoERouter, RouterStats, grouped_linear
from tunelab.modules.norm import RMSNorm
from tunelab.modules.rotary import RotaryEmbedding
from tunelab.modules.shared_prefix import SharedPrefix

__all__ = [
    "Attention",
    "AttentionMask",
    "FeedForward",
    "KVCache",
    "MoEBlock",
    "MoEExperts",
    "MoERouter",
    "RMSNorm",
    "RotaryEmbedding",
    "RouterStats",
    "SharedPrefix",
    "causal_mask",
    "document_causal_mask",
    "grouped_linear",
    "padding_mask",
    "positions_from_document_ids",
]
