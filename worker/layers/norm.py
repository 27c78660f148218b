"""RMSNorm, with the residual add of a pre-norm transformer block fused in.

Runs in worker processes. On CPU in float32 and bfloat16 the add and the norm run as one
compiled op (``cpu_ops.py``) where it could be built, else as the torch ops below. The arithmetic
follows Hugging Face's Llama/Qwen RMSNorm step for step (normalise in float32, cast back, then
scale) so our logits match theirs to rounding. Gemma's variant stores its scale as an offset from
one and scales before casting back (``GemmaRMSNorm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.worker.layers import triton_ops
from conveyor.worker.layers.cpu_ops import DTYPES as COMPILED_DTYPES
from conveyor.worker.layers.cpu_ops import TokenOps, load_token_ops
from conveyor.worker.layers.linear import default_weight_loader
from conveyor.worker.layers.triton_ops import use_triton_ops


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

    def _compiled_ops(self, dtype: torch.dtype) -> TokenOps | None:
        """The compiled ops where they are built and take this norm's weight (checked every
        call: a cheap look, and a loader may still swap the weight's data)."""
        ops = load_token_ops()
        weight = self.weight
        if ops is None or not TokenOps.takes_weight(weight, weight.shape[0], dtype):
            return None
        return ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual)."""
        if x.is_cpu and x.dtype in COMPILED_DTYPES:
            ops = self._compiled_ops(x.dtype)
            # The C op trusts its sizes: a row of another width than the weight goes to torch,
            # which refuses it.
            if (
                ops is not None
                and x.shape[-1] == self.weight.shape[0]
                and TokenOps.takes_rows(x, residual)
            ):
                # One compiled pass instead of five ops (worker/layers/cpu_ops.py).
                normed, summed = ops.add_rms_norm(x, residual, self.weight, self.eps)
                return normed if summed is None else (normed, summed)
        if (
            use_triton_ops(x)
            and x.shape[-1] == self.weight.shape[0]
            and x.dtype == self.weight.dtype
            and x.stride(-1) == 1
            and (
                residual is None
                or (
                    residual.shape == x.shape
                    and residual.dtype == x.dtype
                    and residual.stride(-1) == 1
                )
            )
        ):
            # One kernel instead of five torch ops (worker/layers/triton_ops.py).
            result = triton_ops.add_rms_norm(x, residual, self.weight, self.eps)
            if result is not None:
                normed, summed = result
                return normed if summed is None else (normed, summed)
        if residual is None:
            return rms_normalize(x, self.weight, self.eps)
        x = x + residual
        return rms_normalize(x, self.weight, self.eps), x


def gemma_rms_normalize(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``scale`` (float32, already 1 + weight) * x / rms(x), rounded like Gemma's RMSNorm.

    Gemma scales in float32 and casts the product, where Llama casts first and scales in the
    activation dtype; in float32 the two are the same arithmetic.
    """
    if x.dtype == torch.float32:
        return rms_normalize(x, scale, eps)
    normalized = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return normalized.mul_(scale).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint's weight w scales by (1 + w), so zero is the identity."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        self.scale: torch.Tensor | None = None  # 1 + weight in float32, derived after loading

    def _load(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        self.scale = None  # stale once the weight changes; rebuilt after loading
        default_weight_loader(param, loaded_weight)

    def process_weights_after_loading(self) -> None:
        self.scale = self.scale_of(self.weight)

    @staticmethod
    def scale_of(weight: torch.Tensor) -> torch.Tensor:
        return 1.0 + weight.float()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual)."""
        scale = self.scale if self.scale is not None else self.scale_of(self.weight)
        if residual is None:
            return gemma_rms_normalize(x, scale, self.eps)
        x = x + residual
        return gemma_rms_normalize(x, scale, self.eps), x
