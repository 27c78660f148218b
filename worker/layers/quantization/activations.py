"""Quantized activations as the checkpoint formats' reference runs them: a linear's input
rounded through int8 or FP8 with symmetric scales before the matmul.

Runs in worker processes. ``quantize_activations`` gives the codes and their scales apart (what
the CUDA kernels multiply: codes through the tensor cores, scales after); ``fake_quantize``
multiplies them back into the float input the torch path multiplies. Both round the same way,
so the two paths see the same codes.
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.worker.layers.quantization.scheme import FLOAT8

INT8_MAX = 127.5  # compressed-tensors' symmetric int8 scale: |x| max over half of 255 levels
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def quantize_activations(
    x: torch.Tensor, kind: str, strategy: str, group_size: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, features] -> (codes, scales): the codes float32 [rows, features] on the int8 or
    FP8 grid, the dynamic symmetric scales float32 [rows, 1] ("token"), [1, 1] ("tensor") or
    [rows, groups] ("group": one per ``group_size`` features of a row)."""
    limit = FP8_MAX if kind == FLOAT8 else INT8_MAX
    if strategy == "token":
        scale = x.abs().amax(dim=-1, keepdim=True) / limit
    elif strategy == "tensor":
        scale = x.abs().amax().reshape(1, 1) / limit
    elif strategy == "group":
        rows, features = x.shape
        padded = nn.functional.pad(x, (0, -features % group_size))
        grouped = padded.view(rows, padded.shape[1] // group_size, group_size)
        scale = _nonzero(grouped.abs().amax(dim=-1, keepdim=True) / limit)
        codes = quantize(grouped, scale, kind)
        return codes.reshape(rows, padded.shape[1])[:, :features], scale[..., 0]
    else:
        raise ValueError(f"unknown activation strategy {strategy!r}")
    scale = _nonzero(scale)
    return quantize(x, scale, kind), scale


def fake_quantize(x: torch.Tensor, kind: str, strategy: str, group_size: int = 0) -> torch.Tensor:
    """x [rows, features] rounded through int8 or FP8 with dynamic symmetric scales (one per
    row, per tensor, or per ``group_size`` features of a row) and scaled back."""
    codes, scales = quantize_activations(x, kind, strategy, group_size)
    if strategy == "group":
        scales = scales.repeat_interleave(group_size, dim=1)[:, : x.shape[1]]
    return codes * scales


def quantize(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """x / scale on the int8 grid (rounded to nearest, even on ties, and clamped) or FP8's
    (clamped to its range, then rounded as the cast rounds), as float32 values."""
    scaled = x / scale
    if kind == FLOAT8:
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return torch.round(scaled).clamp(-128, 127)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero row would divide by zero; any positive scale gives it zeros back.
    return torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
