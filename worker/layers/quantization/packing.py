"""Bit packing shared by the checkpoint formats: integers packed into int32 words, and the nibble
pairs our own layout keeps 4-bit codes in.

Runs in worker processes (and in the test fixtures that write quantized checkpoints).
"""

from __future__ import annotations

import torch

# AWQ's GEMM layout: nibble i of a word holds output column AWQ_ORDER[i] of its group of eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """int32 words holding 32 / ``bits`` unsigned values each, lowest bits first, packed along
    ``dim`` (0 or 1) -> the values as uint8, that dimension 32 / ``bits`` times longer.
    ``order``: which of its group's values each slot of a word holds (AWQ's interleave)."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed weights are 2-D int32, got {packed.dtype} {tuple(packed.shape)}")
    per_word = 32 // bits
    words = packed.transpose(0, 1) if dim == 0 else packed
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
    if order is not None:
        values = values[..., [order.index(i) for i in range(per_word)]]
    values = values.reshape(words.shape[0], -1).to(torch.uint8)
    return values.transpose(0, 1).contiguous() if dim == 0 else values


def pack_int32(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """The inverse of ``unpack_int32``: uint8/int values [.., n, ..] -> int32 words along ``dim``."""
    per_word = 32 // bits
    rows = values.transpose(0, 1) if dim == 0 else values
    if rows.shape[1] % per_word:
        raise ValueError(f"{rows.shape[1]} values do not fill whole words of {per_word}")
    groups = rows.to(torch.int64).reshape(rows.shape[0], -1, per_word)
    if order is not None:
        groups = groups[..., list(order)]
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (groups << shifts).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.transpose(0, 1).contiguous() if dim == 0 else words


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [out, in] (uint8, 0-15) -> [out, in / 2] uint8, the even feature low."""
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit weights need an even number of input features, got {codes.shape}")
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[out, in / 2] uint8 -> the codes [out, in] uint8."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
