"""What a quantized linear's checkpoint tensors mean, independent of the format that stored them.

Runs in worker processes. Every format (compressed-tensors, GPTQ, AWQ, FP8) is translated at
load time into one layout per linear, each tensor with output features as its first dimension so
the tensor-parallel loaders slice it as they slice a float weight:

- ``codes``: integer weights as unsigned codes, two 4-bit codes per byte (the even input feature
  in the low nibble) or one 8-bit code per byte, [out, in / 2] or [out, in] uint8; FP8 weights
  as float8_e4m3fn [out, in];
- ``scales``: float32 [out, groups], one per ``group_size`` input features (a whole row when the
  format has one scale per output channel or per tensor, the tensor's scale repeated);
- ``zeros``: float32 [out, groups], the code that means 0.0 (asymmetric integer formats only;
  a symmetric one's is the middle code, 2^(bits-1));
- ``g_idx``: int32 [in], the group of each input feature, where act-order (GPTQ's desc_act)
  quantized the features out of order.

The weight is then ``(codes - zero) * scale`` per group, and what activations go through before
the matmul (nothing, or a fake quantization to int8 or FP8) is ``ActivationScheme``.
"""

from __future__ import annotations

from dataclasses import dataclass

INT = "int"
FLOAT8 = "float8"


@dataclass(frozen=True)
class WeightScheme:
    kind: str  # INT or FLOAT8
    bits: int  # 4 or 8
    # Input features per scale; 0: one scale per output row (per channel, or per tensor).
    group_size: int = 0
    symmetric: bool = True
    act_order: bool = False  # g_idx gives each input feature's group
    # Output rows per scale where the checkpoint's scales are blocks (FP8's 128 x 128 blocks:
    # group_size 128 along the input, block_rows 128 along the output); 0: a scale per row.
    block_rows: int = 0

    @property
    def middle_code(self) -> int:
        return 1 << (self.bits - 1)


@dataclass(frozen=True)
class ActivationScheme:
    """How activations are quantized (and dequantized again) before the matmul, as the format's
    reference runs them: ``kind`` INT (int8) or FLOAT8 (e4m3); ``strategy`` "token" (one dynamic
    scale per row), "tensor" (one, dynamic or the checkpoint's static ``input_scale``) or "group"
    (one dynamic scale per ``group_size`` features of a row)."""

    kind: str
    strategy: str
    dynamic: bool = True
    group_size: int = 0


@dataclass(frozen=True)
class LinearScheme:
    weights: WeightScheme
    activations: ActivationScheme | None = None

    def describe(self) -> str:
        w = self.weights
        name = f"{'fp' if w.kind == FLOAT8 else 'int'}{w.bits}"
        name += f" group {w.group_size}" if w.group_size else " per row"
        name += "" if w.symmetric else " with zero points"
        name += " act-order" if w.act_order else ""
        if self.activations is not None:
            a = self.activations
            name += f", activations {'fp8' if a.kind == FLOAT8 else 'int8'} per {a.strategy}"
        return name
