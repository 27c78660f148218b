"""MXFP4 (OCP microscaling FP4): how gpt-oss checkpoints store their experts, unpacked at load.

Runs in worker processes. Every 32 consecutive weights of a row share one scale: 16 bytes hold
the 32 values as 4-bit E2M1 codes (low nibble first), and one byte holds the block's power-of-two
exponent biased by 127 (E8M0). gpt-oss keeps the experts' ``*_blocks`` [..., rows, groups, 16]
and ``*_scales`` [..., rows, groups]; everything else is bf16.

We unpack to the model's dtype once, when the weights load, and run the experts as dense
matmuls: the CPU has no FP4 arithmetic to exploit and the values (a 3-bit mantissa at most,
scaled by a power of two) are exact in bfloat16 and float32, so the result equals what the
checkpoint means bit for bit. The memory cost is 4x (bf16) the packed size.
"""

from __future__ import annotations

import torch

# E2M1: sign, two exponent bits, one mantissa bit. Codes 0-7 positive, 8-15 their negatives.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
VALUES_PER_BLOCK = 32
BYTES_PER_BLOCK = 16
SCALE_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """blocks [..., groups, 16] uint8 and scales [..., groups] uint8 -> [..., groups * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[-1] != BYTES_PER_BLOCK or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    magnitudes = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    table = torch.cat([magnitudes, -magnitudes])
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # low nibble first
    values = table[codes.long()]  # [..., groups, 32] float32
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).to(dtype)
