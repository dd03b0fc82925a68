"""The Qwen2.5-VL vision tower: patches to language-model embeddings.

(Qwen3-VL's tower shares the patch embedding, attention and 2D rotary defined here; it lives
in ``tunelab.modules.vision_qwen3``. ``VisionArgs.layout`` says which tower a model has.)

Qwen2.5-VL (Bai et al., 2025, https://arxiv.org/abs/2502.13923). An image of ``h x w`` patches
(a patch is ``temporal_patch_size`` frames of ``patch_size``-square pixels, flattened) goes
through:

1. a patch embedding, a linear map of each flattened patch (HF keeps it as a ``Conv3d`` whose
   kernel equals its stride, the same map; its weight keeps that shape here for the keys);
2. ``depth`` pre-norm blocks (RMSNorm, attention, RMSNorm, gated MLP with biases). Attention
   is bidirectional. Most blocks attend within windows of ``window_size`` pixels;
   ``full_attention_blocks`` attend over the whole frame. Queries and keys rotate with a 2D
   rotary embedding: the first half of the rotated pairs follow the patch row, the second
   half the patch column, each with ``inv_freq[i] = theta ** (-4i / head_dim)``;
3. the patch merger: RMSNorm, then each ``spatial_merge_size``-square of patches concatenated
   and mapped by ``Linear, GELU, Linear`` to one language-model embedding.

Patches are ordered block-major (each merge square's patches adjacent), as the image
processor writes them. For window attention the merge squares are regrouped window by
window, and put back in image order after the merger.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tunelab.errors import ConfigError
from tunelab.modules.feed_forward import FeedForward
from tunelab.modules.norm import RMSNorm
from tunelab.modules.rotary import _rotate_half

_NORM_EPS = 1e-6


VISION_LAYOUTS = ("qwen2_5_vl", "qwen3_vl", "gemma3")
"""The vision towers tunelab builds, by the family that introduced them."""


@dataclass
class VisionArgs:
    """Shape of a vision tower (HF ``vision_config``) and its token ids.

    Qwen2.5-VL and Qwen3-VL towers, or Gemma 3's SigLIP tower and projector (``layout``
    ``gemma3``: ``tunelab.modules.vision_siglip``; the ``qwen`` patch, merge and rotary fields
    do not apply to it).
    """

    depth: int
    """Vision transformer blocks."""
    dim: int
    """Width of the vision blocks, HF ``hidden_size``."""
    intermediate_dim: int
    """Hidden size of each block's gated MLP."""
    num_heads: int
    """Attention heads of each block."""
    out_dim: int
    """Width of the patch merger's output (the language model's ``hidden_size``)."""
    patch_size: int = 14
    """Side of a square patch, in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """Side of the square of patches the merger turns into one language token."""
    in_channels: int = 3
    """Colour channels of the pixels."""
    window_size: int = 112
    """Side of a window-attention window, in pixels."""
    full_attention_blocks: list[int] = field(default_factory=list)
    """Blocks that attend over the whole image (HF ``fullatt_block_indexes``); the others
    attend within windows."""
    hidden_act: str = "silu"
    """Gate activation of the blocks' MLPs."""
    rope_theta: float = 10000.0
    """Base of the vision tower's 2D rotary embedding."""
    tokens_per_second: int = 4
    """Temporal positions per second of video (HF ``tokens_per_second``)."""
    image_token_id: int = 151655
    """The token each image embedding replaces."""
    video_token_id: int = 151656
    """The token each video embedding replaces."""
    vision_start_token_id: int = 151652
    """The token before an image's tokens."""
    vision_end_token_id: int = 151653
    """The token after an image's tokens."""
    layout: str = "qwen2_5_vl"
    """Which tower, one of ``VISION_LAYOUTS``: ``qwen2_5_vl`` (RMSNorm, gated MLP, window
    attention; ``tunelab.modules.vision.VisionTransformer``), ``qwen3_vl`` (LayerNorm, plain
    MLP, full attention, learned position embeddings, deepstack;
    ``tunelab.modules.vision_qwen3.Qwen3VisionTransformer``) or ``gemma3`` (SigLIP and an
    average-pooling projector; ``tunelab.modules.vision_siglip``)."""
    num_position_embeddings: int = 0
    """Qwen3-VL: rows of the learned position table, a square grid resampled to each image."""
    deepstack_blocks: list[int] = field(default_factory=list)
    """Qwen3-VL: blocks whose output a merger of its own adds into the language model's
    hidden states at the image tokens, after layer 0, 1, ... (HF ``deepstack_visual_indexes``)."""
    image_size: int = 0
    """Gemma 3: the side every image (and pan-and-scan crop) is resized to, in pixels."""
    tokens_per_image: int = 0
    """Gemma 3: language tokens per image (HF ``mm_tokens_per_image``), a square number."""
    norm_eps: float = 1e-6
    """Gemma 3: epsilon of the tower's LayerNorms and the projector's RMSNorm (HF
    ``layer_norm_eps``)."""

    def __post_init__(self) -> None:
        if self.layout not in VISION_LAYOUTS:
            raise ConfigError(f"vision layout {self.layout!r} is not one of {VISION_LAYOUTS}")
        if self.layout == "gemma3":
            self._check_gemma3()
            return
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 4:
            raise ConfigError(
                f"vision hidden_size {self.dim} must split into {self.num_heads} heads whose "
                "size is a multiple of 4 (2D rotary)"
            )
        if self.layout == "qwen2_5_vl" and self.window_size % (
            self.patch_size * self.spatial_merge_size
        ):
            raise ConfigError(
                f"vision window_size {self.window_size} must be a multiple of patch_size x "
                f"spatial_merge_size ({self.patch_size * self.spatial_merge_size})"
            )
        self.full_attention_blocks = [int(index) for index in self.full_attention_blocks]
        self.deepstack_blocks = [int(index) for index in self.deepstack_blocks]
        if any(not 0 <= index < self.depth for index in self.deepstack_blocks):
            raise ConfigError(
                f"vision deepstack_visual_indexes {self.deepstack_blocks} must be blocks "
                f"0..{self.depth - 1}"
            )
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ConfigError(
                f"vision num_position_embeddings {self.num_position_embeddings} must be a square"
            )

    def _check_gemma3(self) -> None:
        if self.dim % self.num_heads:
            raise ConfigError(
                f"vision hidden_size {self.dim} must split into {self.num_heads} heads"
            )
        side = self.image_size // self.patch_size if self.patch_size > 0 else 0
        tokens_side = round(self.tokens_per_image**0.5)
        if side <= 0 or side * self.patch_size != self.image_size:
            raise ConfigError(
                f"vision image_size {self.image_size} must be a positive multiple of "
                f"patch_size {self.patch_size}"
            )
        if tokens_side < 1 or tokens_side**2 != self.tokens_per_image or side % tokens_side:
            raise ConfigError(
                f"mm_tokens_per_image {self.tokens_per_image} must be the square of a divisor "
                f"of the {side} patches per image side"
            )

    @property
    def patches_per_side(self) -> int:
        """Gemma 3: patches along each side of an image."""
        return self.image_size // self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches per language token (``spatial_merge_size ** 2``)."""
        return self.spatial_merge_size**2

    @property
    def patch_features(self) -> int:
        """Values per flattened patch: channels x frames x side x side."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def patch_positions(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """Each patch's ``(row, column)`` in its frame, in the block-major patch order.

    Args:
        grid_thw: long ``[images, 3]``: frames, patch rows, patch columns of each image.
        merge_size: side of a merge square.

    Returns:
        Long ``[patches, 2]``.
    """
    positions = []
    for frames, rows, columns in grid_thw.tolist():
        row, column = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
        blocks = (rows // merge_size, merge_size, columns // merge_size, merge_size)
        row = row.reshape(blocks).transpose(1, 2).flatten()
        column = column.reshape(blocks).transpose(1, 2).flatten()
        positions.append(torch.stack((row, column), dim=-1).repeat(frames, 1))
    return torch.cat(positions).to(grid_thw.device)


def window_order(
    grid_thw: torch.Tensor, merge_size: int, window_merges: int
) -> tuple[torch.Tensor, list[int]]:
    """The merge squares regrouped window by window, and each window's patch count.

    A frame's ``rows / merge x columns / merge`` grid of merge squares is cut into windows of
    ``window_merges`` squares a side, from the top left; windows on the bottom and right
    edges may be smaller.

    Args:
        grid_thw: long ``[images, 3]``.
        merge_size: side of a merge square, in patches.
        window_merges: side of a window, in merge squares.

    Returns:
        ``(order, lengths)``: ``order[i]`` is the merge square at position ``i`` of the
        windowed sequence; ``lengths`` the patches of each window, in order.
    """
    order, lengths, offset = [], [], 0
    for frames, rows, columns in grid_thw.tolist():
        grid_rows, grid_columns = rows // merge_size, columns // merge_size
        index = torch.arange(frames * grid_rows * grid_columns).view(
            frames, grid_rows, grid_columns
        )
        for frame in range(frames):
            for top in range(0, grid_rows, window_merges):
                for left in range(0, grid_columns, window_merges):
                    window = index[frame, top : top + window_merges, left : left + window_merges]
                    order.append(window.flatten() + offset)
                    lengths.append(window.numel() * merge_size**2)
        offset += frames * grid_rows * grid_columns
    return torch.cat(order).to(grid_thw.device), lengths


def vision_rotary(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` ``[patches, head_dim]`` of the 2D rotary embedding.

    The first half of each head's rotated pairs follow the patch row, the second half the
    column, with ``inv_freq[i] = theta ** (-4i / head_dim)``.

    Args:
        positions: long ``[patches, 2]``: each patch's row and column.
        head_dim: features per attention head.
        theta: the rotary base.
    """
    quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float, device=positions.device)
    inv_freq = 1.0 / (theta ** (quarter / (head_dim // 2)))
    angles = (positions[..., None].float() * inv_freq).flatten(1)  # rows' then columns'
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over segments of patches, with 2D rotary.

    Names match HF: one ``qkv`` projection (q, k, v concatenated) and ``proj``, both biased.

    Args:
        dim: width of the blocks.
        num_heads: attention heads.
    """

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """Attend within each segment.

        Args:
            x: ``[patches, dim]``.
            cos: ``[patches, head_dim]``, fp32.
            sin: ``[patches, head_dim]``, fp32.
            lengths: patches of each segment, in order (they sum to ``patches``).

        Returns:
            ``[patches, dim]``.
        """
        patches = x.shape[0]
        qkv = self.qkv(x).view(patches, 3, self.num_heads, self.head_dim)
        # Rotate q and k in one pass (half the ops of one each), in fp32 and cast back, as
        # transformers does.
        qk = qkv[:, :2].float()
        cos, sin = cos[:, None, None], sin[:, None, None]
        q, k = (qk * cos + _rotate_half(qk) * sin).to(x.dtype).unbind(1)
        v = qkv[:, 2]
        # [1, heads, patches, head_dim]: 4-D inputs take the fused (flash) CPU kernel, as in
        # transformers; 3-D ones fall back to the math path (2-3x the time per window).
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        outputs = [
            F.scaled_dot_product_attention(q_part, k_part, v_part)
            for q_part, k_part, v_part in zip(
                q.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2)
            )
        ]
        return self.proj(torch.cat(outputs, dim=2)[0].transpose(0, 1).reshape(patches, -1))


class VisionBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``.

    Args:
        args: the tower's shape.
        norm: builds each norm from the width; None for RMSNorm (Qwen2.5-VL; Qwen3-VL passes
            LayerNorm).
        mlp: the MLP; None for the gated one with biases (Qwen2.5-VL).
    """

    def __init__(
        self,
        args: VisionArgs,
        norm: Callable[[int], nn.Module] | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        norm = norm or functools.partial(RMSNorm, eps=_NORM_EPS)
        self.norm1 = norm(args.dim)
        self.norm2 = norm(args.dim)
        self.attn = VisionAttention(args.dim, args.num_heads)
        if mlp is None:
            mlp = FeedForward(
                args.dim, args.intermediate_dim, bias=True, activation=args.hidden_act
            )
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """Apply the block (see ``VisionAttention.forward``)."""
        h = x + self.attn(self.norm1(x), cos, sin, lengths)
        return h + self.mlp(self.norm2(h))


class FlatConv3d(nn.Module):
    """HF's patch ``Conv3d`` (kernel equal to its stride) as the linear map it is.

    The weight keeps the convolution's shape ``[dim, channels, frames, side, side]`` and name;
    the forward flattens it. A module of its own so FSDP2 gathers its parameters when it
    runs, as for any other layer.
    """

    def __init__(self, args: VisionArgs, bias: bool) -> None:
        super().__init__()
        self.features = args.patch_features
        shape = (
            args.dim,
            args.in_channels,
            args.temporal_patch_size,
            args.patch_size,
            args.patch_size,
        )
        self.weight = nn.Parameter(torch.empty(shape))
        nn.init.normal_(self.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(args.dim)) if bias else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[patches, features]`` to ``[patches, dim]``."""
        flat = pixels.to(self.weight.dtype).view(-1, self.features)
        return F.linear(flat, self.weight.flatten(1), self.bias)


class PatchEmbed(nn.Module):
    """A linear map of each flattened patch, under HF's ``Conv3d`` weight shape and name.

    Args:
        args: the tower's shape.
        bias: whether the map has a bias (Qwen3-VL's does).
    """

    def __init__(self, args: VisionArgs, bias: bool = False) -> None:
        super().__init__()
        self.proj = FlatConv3d(args, bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[patches, features]`` to ``[patches, dim]``."""
        return self.proj(pixels)


class PatchMerger(nn.Module):
    """RMSNorm, then each merge square's patches concatenated and mapped by an MLP."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.merged_dim = args.dim * args.merge_unit
        self.ln_q = RMSNorm(args.dim, eps=_NORM_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            nn.Linear(self.merged_dim, args.out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[patches, dim]`` to ``[patches / merge_unit, out_dim]``."""
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


class VisionTransformer(nn.Module):
    """The Qwen2.5-VL vision tower (module names are HF's under ``visual.``).

    Args:
        args: the tower's shape.
    """

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        self.merger = PatchMerger(args)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Embed images for the language model.

        Args:
            pixel_values: ``[patches, patch_features]``, the images' patches in the image
                processor's order, image after image.
            grid_thw: long ``[images, 3]``: frames, patch rows and columns of each image.

        Returns:
            ``(embeddings, [])``: ``[patches / merge_unit, out_dim]``, each image's language
            tokens in order, and no deepstack features (Qwen3-VL's tower has some).
        """
        args = self.args
        unit = args.merge_unit
        x = self.patch_embed(pixel_values)
        patches = x.shape[0]
        order, window_lengths = window_order(
            grid_thw,
            args.spatial_merge_size,
            args.window_size // args.spatial_merge_size // args.patch_size,
        )
        frame_lengths = [
            rows * columns for frames, rows, columns in grid_thw.tolist() for _ in range(frames)
        ]
        x = x.view(patches // unit, unit, -1)[order].view(patches, -1)
        positions = patch_positions(grid_thw, args.spatial_merge_size)
        positions = positions.view(patches // unit, unit, 2)[order].view(patches, 2)
        cos, sin = vision_rotary(positions, args.dim // args.num_heads, args.rope_theta)
        full = set(args.full_attention_blocks)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lengths if index in full else window_lengths)
        return self.merger(x)[torch.argsort(order)], []
