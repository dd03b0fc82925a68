"""Gemma 3's vision tower (SigLIP) and its multimodal projector: images to soft tokens.

Gemma 3 (Gemma Team, 2025, https://arxiv.org/abs/2503.19786) reads each image, resized to
``image_size`` pixels a side, with a SigLIP vision transformer (Zhai et al., 2023,
https://arxiv.org/abs/2303.15343) and turns its patches into ``tokens_per_image`` language
tokens:

1. the patch embedding, a ``Conv2d`` whose kernel equals its stride (``patch_size``), plus a
   learned position embedding per patch (the grid is always ``image_size / patch_size`` a
   side, so the table is never resampled);
2. ``depth`` pre-LayerNorm blocks: ``h = x + attn(layer_norm1(x)); out = h +
   mlp(layer_norm2(h))``, bidirectional multi-head attention over the image's patches with
   biased ``q/k/v/out`` projections, and a ``fc1, GELU(tanh), fc2`` MLP;
3. a final LayerNorm (``post_layernorm``);
4. the projector: the patch grid average-pooled to ``sqrt(tokens_per_image)`` a side, each
   pooled vector normed by a Gemma RMSNorm (scale ``1 + weight``, ``mm_soft_emb_norm``) and
   multiplied by ``mm_input_projection_weight`` (``[vision dim, text dim]``, no bias).

Module names are transformers 5's under ``vision_tower.`` and ``multi_modal_projector.``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from tunelab.modules.feed_forward import tower_activation
from tunelab.modules.norm import RMSNorm
from tunelab.modules.vision import VisionArgs


class SiglipEmbeddings(nn.Module):
    """Patch embedding (a strided ``Conv2d``) plus a learned position embedding per patch."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            args.in_channels, args.dim, kernel_size=args.patch_size, stride=args.patch_size
        )
        self.position_embedding = nn.Embedding(args.patches_per_side**2, args.dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, channels, side, side]`` to ``[images, patches, dim]``."""
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        positions = torch.arange(patches.shape[1], device=patches.device)
        return patches + self.position_embedding(positions)


class SiglipAttention(nn.Module):
    """Bidirectional multi-head attention with biased projections (HF's names)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[images, patches, dim]`` to the same shape."""
        images, patches, dim = x.shape
        q, k, v = (
            proj(x).view(images, patches, self.num_heads, -1).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(images, patches, dim))


class SiglipMLP(nn.Module):
    """``fc2(act(fc1(x)))``, both biased (``gelu_pytorch_tanh`` as ``feed_forward.gelu_tanh``)."""

    def __init__(self, dim: int, intermediate_dim: int, activation: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, intermediate_dim)
        self.fc2 = nn.Linear(intermediate_dim, dim)
        self.activation = tower_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., dim]`` to ``[..., dim]``."""
        return self.fc2(self.activation(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    """Pre-LayerNorm block: ``h = x + attn(layer_norm1(x)); out = h + mlp(layer_norm2(h))``."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.self_attn = SiglipAttention(args.dim, args.num_heads)
        self.layer_norm2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = SiglipMLP(args.dim, args.intermediate_dim, args.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``[images, patches, dim]``."""
        h = x + self.self_attn(self.layer_norm1(x))
        return h + self.mlp(self.layer_norm2(h))


class SiglipEncoder(nn.Module):
    """The blocks, under HF's ``encoder.layers``."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(args) for _ in range(args.depth))


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer without a pooling head (HF ``SiglipVisionModel``).

    Args:
        args: the tower's shape (``layout`` ``gemma3``).
    """

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(args)
        self.encoder = SiglipEncoder(args)
        self.post_layernorm = nn.LayerNorm(args.dim, eps=args.norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, channels, side, side]`` to ``[images, patches, dim]``."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    """Average-pool the patch grid, RMSNorm, project to the language model's width.

    Args:
        args: the tower's shape; ``out_dim`` is the language model's width.
    """

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.side = args.patches_per_side
        self.kernel = self.side // round(args.tokens_per_image**0.5)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(args.dim, args.out_dim))
        nn.init.normal_(self.mm_input_projection_weight, std=0.02)
        self.mm_soft_emb_norm = RMSNorm(args.dim, eps=args.norm_eps, unit_offset=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """``[images, patches, dim]`` to ``[images, tokens_per_image, out_dim]``."""
        images, _, dim = patches.shape
        grid = patches.transpose(1, 2).reshape(images, dim, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        projected = self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight
        return projected.to(patches.dtype)
