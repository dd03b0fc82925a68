"""The Qwen3-VL vision tower: patches to language-model embeddings and deepstack features.

Qwen3-VL (Qwen team, 2025, https://arxiv.org/abs/2511.21631) keeps Qwen2.5-VL's patch
embedding (now biased), bidirectional attention with a 2D rotary embedding and patch merger
(``tunelab.modules.vision``), and changes the rest:

1. a learned position table of ``side x side`` entries is resampled bilinearly (corners
   aligned) to each image's patch grid and added to the patch embeddings;
2. the blocks (``VisionBlock``) use LayerNorm and a plain ``Linear, GELU(tanh), Linear`` MLP with biases, and
   every block attends over the whole frame (no windows);
3. the merger is ``LayerNorm, Linear, GELU, Linear`` (HF names ``norm``, ``linear_fc1``,
   ``linear_fc2``);
4. DeepStack (Meng et al., 2024, https://arxiv.org/abs/2406.04334): the output of each block
   in ``deepstack_blocks`` goes through a merger of its own (LayerNorm after the merge
   squares are concatenated) and the language model adds the ``k``-th of them to the hidden
   states at the image tokens after its layer ``k``.

Module names are HF's under ``visual.``.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tunelab.modules.feed_forward import tower_activation
from tunelab.modules.vision import (
    PatchEmbed,
    VisionArgs,
    VisionBlock,
    patch_positions,
    vision_rotary,
)

_NORM_EPS = 1e-6


class VisionMLP(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))``, both biased (HF ``Qwen3VLVisionMLP``).

    ``gelu_pytorch_tanh`` (the hub checkpoints') runs as ``feed_forward.gelu_tanh``.
    """

    def __init__(self, dim: int, intermediate_dim: int, activation: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, intermediate_dim)
        self.linear_fc2 = nn.Linear(intermediate_dim, dim)
        self.activation = tower_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., dim]`` to ``[..., dim]``."""
        return self.linear_fc2(self.activation(self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """Each merge square's patches concatenated and mapped by ``Linear, GELU, Linear``.

    Args:
        args: the tower's shape.
        norm_after_merge: LayerNorm over the concatenated square (the deepstack mergers)
            instead of over each patch (the final merger).
    """

    def __init__(self, args: VisionArgs, norm_after_merge: bool = False) -> None:
        super().__init__()
        self.merged_dim = args.dim * args.merge_unit
        self.norm_after_merge = norm_after_merge
        self.norm = nn.LayerNorm(self.merged_dim if norm_after_merge else args.dim, eps=_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, args.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[patches, dim]`` to ``[patches / merge_unit, out_dim]``."""
        if self.norm_after_merge:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def bilinear_taps(
    side: int, grid_thw: torch.Tensor, merge_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each patch reads a square learned position table, and with what weights.

    Bilinear with corners aligned (``F.interpolate(align_corners=True)``): patch row ``r`` of
    ``h`` reads table row ``r * (side - 1) / (h - 1)``, weighted between its two neighbours,
    and likewise for columns.

    Args:
        side: the table's side (it holds ``side * side`` rows, row-major).
        grid_thw: long ``[images, 3]``.
        merge_size: side of a merge square (patches come block-major).

    Returns:
        ``(indices, weights)``: long and fp32 ``[patches, 4]``, in the patch order of
        ``patch_positions``; a patch's embedding is ``sum(table[indices] * weights)``.
    """
    positions = patch_positions(grid_thw, merge_size).float()
    sizes = torch.cat(
        [
            torch.tensor([[rows, columns]]).expand(frames * rows * columns, 2)
            for frames, rows, columns in grid_thw.tolist()
        ]
    ).to(positions)
    source = positions * (side - 1) / (sizes - 1).clamp(min=1)
    low = source.floor()
    fraction = source - low
    low = low.long()
    high = (low + 1).clamp(max=side - 1)
    (row_low, column_low), (row_high, column_high) = low.unbind(1), high.unbind(1)
    row_weight, column_weight = fraction.unbind(1)
    indices = torch.stack(
        (
            row_low * side + column_low,
            row_low * side + column_high,
            row_high * side + column_low,
            row_high * side + column_high,
        ),
        dim=1,
    )
    weights = torch.stack(
        (
            (1 - row_weight) * (1 - column_weight),
            (1 - row_weight) * column_weight,
            row_weight * (1 - column_weight),
            row_weight * column_weight,
        ),
        dim=1,
    )
    return indices, weights


class Qwen3VisionTransformer(nn.Module):
    """The Qwen3-VL vision tower (module names are HF's under ``visual.``).

    Args:
        args: the tower's shape (``layout`` ``qwen3_vl``).
    """

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args, bias=True)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.dim)
        layer_norm = functools.partial(nn.LayerNorm, eps=_NORM_EPS)
        self.blocks = nn.ModuleList(
            VisionBlock(
                args, layer_norm, VisionMLP(args.dim, args.intermediate_dim, args.hidden_act)
            )
            for _ in range(args.depth)
        )
        self.merger = Qwen3PatchMerger(args)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(args, norm_after_merge=True) for _ in args.deepstack_blocks
        )

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Embed images for the language model.

        Args:
            pixel_values: ``[patches, patch_features]``, the images' patches in the image
                processor's order, image after image.
            grid_thw: long ``[images, 3]``: frames, patch rows and columns of each image.

        Returns:
            ``(embeddings, deepstack)``: ``[patches / merge_unit, out_dim]``, each image's
            language tokens in order, and one tensor of that shape per deepstack block.
        """
        args = self.args
        x = self.patch_embed(pixel_values)
        side = round(args.num_position_embeddings**0.5)
        indices, weights = bilinear_taps(side, grid_thw, args.spatial_merge_size)
        # The table is read through its module (FSDP2 gathers it then); weights in fp32
        # whatever the table's dtype, as transformers does.
        table = self.pos_embed(indices)  # [patches, 4, dim]
        x = x + (table * weights[..., None]).sum(1).to(x.dtype)
        positions = patch_positions(grid_thw, args.spatial_merge_size)
        cos, sin = vision_rotary(positions, args.dim // args.num_heads, args.rope_theta)
        frame_lengths = [
            rows * columns for frames, rows, columns in grid_thw.tolist() for _ in range(frames)
        ]
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lengths)
            if index in args.deepstack_blocks:
                merger = self.deepstack_merger_list[args.deepstack_blocks.index(index)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack
