"""The gated activations of SwiGLU and GeGLU MLPs.

Runs in worker processes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.worker.layers import triton_ops
from conveyor.worker.layers.cpu_ops import TokenOps, load_token_ops
from conveyor.worker.layers.triton_ops import use_triton_ops


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dimension -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if TokenOps.takes_gated(x):
            ops = load_token_ops()
            if ops is not None:
                # One compiled pass (worker/layers/cpu_ops.py): torch's silu and product cost
                # 2-4x more per call between a served step's matmuls.
                return ops.silu_and_mul(x)
        if use_triton_ops(x) and x.stride(-1) == 1:
            out = triton_ops.silu_and_mul(x)  # one kernel for two (worker/layers/triton_ops.py)
            if out is not None:
                return out
        gate, up = x.chunk(2, dim=-1)
        # Multiplying into silu's fresh output saves an allocation and a pass over memory
        # (~10% at prefill sizes); silu in place on the strided gate half measured slower.
        return F.silu(gate).mul_(up)


class GeluAndMul(nn.Module):
    """x = [gate | up] -> gelu(gate) * up (GeGLU; Gemma's ``gelu_pytorch_tanh`` is "tanh")."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate).mul_(up)
