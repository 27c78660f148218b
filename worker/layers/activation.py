"""The gated activation of SwiGLU MLPs.

Runs in worker processes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dimension -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        # Multiplying into silu's fresh output saves an allocation and a pass over memory
        # (~10% at prefill sizes); silu in place on the strided gate half measured slower.
        return F.silu(gate).mul_(up)
