"""MXFP4 test data built from the format's definition, independently of tunelab's reader."""

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4_codes(
    shape: tuple[int, int, int], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes of a weight ``[E, rows, cols]``, and the weight they encode.

    Each value is a random 4-bit code (bit 3 the sign, bits 0-2 an E2M1 magnitude), each block
    of 32 values along ``cols`` a random E8M0 scale ``s`` (``2 ** (s - 127)``, kept between
    ``2 ** -8`` and ``2 ** -4`` so the weights stay small); codes are packed two to a byte, the
    even value in the low nibble, as gpt-oss checkpoints pack them.

    Returns:
        ``(blocks uint8 [E, rows, cols / 32, 16], scales uint8 [E, rows, cols / 32],
        weight fp32 [E, rows, cols])``.
    """
    experts, rows, cols = shape
    codes = torch.randint(0, 16, (experts, rows, cols), generator=generator)
    exponents = torch.randint(119, 124, (experts, rows, cols // 32), generator=generator)
    magnitude = torch.tensor(E2M1_MAGNITUDES)[codes % 8]
    sign = torch.where(codes >= 8, -1.0, 1.0)
    weight = sign * magnitude * 2.0 ** (exponents.repeat_interleave(32, dim=-1) - 127.0)
    pairs = codes.view(experts, rows, cols // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, exponents.to(torch.uint8), weight
