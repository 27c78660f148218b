"""RMSNorm, with the residual add of a pre-norm transformer block fused in.

Runs in worker processes. The arithmetic follows Hugging Face's Llama/Qwen RMSNorm step for step
(normalise in float32, cast back, then scale) so our logits match theirs to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension, rounded like Hugging Face's RMSNorm.

    ``weight`` may cover more than the last dimension (a per-head weight [heads, head_dim] over
    x [tokens, heads, head_dim]); it broadcasts.
    """
    size = x.shape[-1]
    if x.dtype == torch.float32:
        # One fused reduction for the sum of squares: F.rms_norm (pow, mean, ...) and the
        # spelled-out HF ops were 20-30% slower (bench_layers); equal to within float32 rounding.
        sum_of_squares = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_()
        inverse_rms = sum_of_squares.mul_(1.0 / size).add_(eps).rsqrt_()
        return torch.mul(x, inverse_rms).mul_(weight)
    normalized = F.rms_norm(x.float(), (size,), None, eps)
    return weight * normalized.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_normalize(x, self.weight, self.eps)
        x = x + residual
        return rms_normalize(x, self.weight, self.eps), x
