"""MXFP4 weights, as gpt-oss publishes its experts, dequantized to floating point.

MXFP4 (OCP Microscaling Formats MX v1.0, https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf)
stores blocks of 32 values that share one power-of-two scale. Each value is FP4 E2M1 (one of
``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}``), two to a byte, the low nibble first; each block's scale is
E8M0, one byte ``s`` meaning ``2 ** (s - 127)``. gpt-oss checkpoints hold an expert weight
``W`` ``[E, rows, cols]`` as ``*_blocks`` uint8 ``[E, rows, cols / 32, 16]`` and ``*_scales``
uint8 ``[E, rows, cols / 32]``: row ``r`` of expert ``e`` is the ``cols / 32`` blocks
``blocks[e, r]`` scaled by ``scales[e, r]``.
"""

import torch

from tunelab.errors import CheckpointError

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of the FP4 E2M1 codes 0..7; codes 8..15 are their negatives."""
_SCALE_BIAS = 127
_BLOCK_SIZE = 32


def _code_table(device: torch.device) -> torch.Tensor:
    magnitudes = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weights of MXFP4 ``blocks`` and ``scales``, one leading index at a time.

    Args:
        blocks: uint8 ``[..., groups, 16]``, two FP4 codes per byte (low nibble first).
        scales: uint8 ``[..., groups]``, each group's E8M0 exponent (biased by 127).
        dtype: the result's dtype.

    Returns:
        ``[..., groups * 32]``: value ``2 * j + n`` of group ``g`` is
        ``FP4(nibble n of blocks[..., g, j]) * 2 ** (scales[..., g] - 127)``.

    Raises:
        CheckpointError: the dtypes or shapes do not fit together.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != _BLOCK_SIZE // 2:
        raise CheckpointError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
            f"(blocks must be scales' shape plus {_BLOCK_SIZE // 2} bytes)"
        )
    table = _code_table(blocks.device)
    out = torch.empty(
        (*scales.shape[:-1], scales.shape[-1] * _BLOCK_SIZE), dtype=dtype, device=blocks.device
    )
    flat_blocks = blocks.reshape(-1, *blocks.shape[-2:])
    flat_scales = scales.reshape(-1, scales.shape[-1])
    flat_out = out.view(-1, out.shape[-1])
    # One leading row at a time: the index tensors of a whole layer's experts would take
    # several times the weights' own memory.
    for row in range(flat_blocks.shape[0]):
        codes = flat_blocks[row].to(torch.int64)
        values = torch.stack([table[codes & 0x0F], table[codes >> 4]], dim=-1).flatten(-2)
        exponents = flat_scales[row].to(torch.int32)[:, None] - _SCALE_BIAS
        flat_out[row] = torch.ldexp(values, exponents).flatten().to(dtype)
    return out
