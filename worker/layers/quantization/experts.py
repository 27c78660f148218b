"""Mixture-of-experts experts from a quantized checkpoint: which schemes run, and how.

Runs in worker processes. Each expert's gate/up and down projections load as one quantized
column-parallel and one row-parallel linear (``QuantizedExpert``, under the expert's index, so a
checkpoint's ``mlp.experts.3.gate_proj`` lands in ``mlp.experts.3.gate_up_proj``), through the
same loaders and tensor-parallel slicing as a dense layer's. Then, by scheme:

- integer weights stay at their bits, each expert's pair of linears as a dense layer's would:
  4-bit ones (compressed-tensors W4A16, GPTQ, AWQ) in the compiled 4-bit kernel's panels
  (int4_kernel.py), 8-bit ones (GPTQ 8-bit, W8A16) in the int8 kernel's, act-order ones sorted by
  group at load first, W8A8 with its int8 activations in the int8 kernel's VNNI path; the expert
  matmul reads the weights' own bits, the point of a quantized MoE on a CPU, where a decode step
  reads every picked expert's weights;
- FP8 weights (``fp8`` per tensor or in blocks, compressed-tensors FP8) are multiplied out once
  at load into the experts' float stacks, which then take the oneDNN-packed path float experts
  have: a CPU has no FP8 matmul, and upcasting at load costs memory once instead of a dequantize
  per expert per step. The experts' inputs stay float, as transformers runs FP8 experts on CPU
  (it dequantizes them); only a dynamic activation scheme is taken, static input scales are
  refused.

Static input scales on FP8 experts are refused by name at load.
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from conveyor.worker.layers.quantization.base import UnsupportedQuantization
from conveyor.worker.layers.quantization.scheme import FLOAT8, LinearScheme


def check_expert_scheme(scheme: LinearScheme) -> None:
    """Refuse, by name, what the experts do not run."""
    w, a = scheme.weights, scheme.activations
    what = f"quantized experts ({scheme.describe()})"
    if w.kind == FLOAT8 and a is not None and not a.dynamic:
        raise UnsupportedQuantization(f"{what}: static input scales on FP8 experts")


class QuantizedExpert(nn.Module):
    """One expert's [gate; up] and down projections as quantized linears (this rank's share)."""

    def __init__(
        self,
        scheme: LinearScheme,
        hidden_size: int,
        intermediate_size: int,
        tp_rank: int,
        tp_size: int,
    ) -> None:
        super().__init__()
        size = intermediate_size  # the full width; the linears take this rank's share
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [size, size], False, tp_rank, tp_size
        )
        self.down_proj = RowParallelLinear(size, hidden_size, False, tp_rank, tp_size)
        for layer in (self.gate_up_proj, self.down_proj):
            layer.use_quantized_weights(scheme)

    def project(
        self, rows: torch.Tensor, part: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """rows @ W^T (+ bias) for gate_up (part 0) or down (part 1), without the all-reduce
        a row-parallel layer does: the experts' sum is reduced once for the whole block."""
        return (self.gate_up_proj, self.down_proj)[part].matmul(rows, bias)
