"""AWQ checkpoints (``quant_method: awq``, AutoAWQ's GEMM layout).

Runs in worker processes. Per linear: ``qweight`` int32 [in, out / 8], eight 4-bit codes of
consecutive output features per word in AWQ's interleaved order (packing.AWQ_ORDER); ``qzeros``
int32 [groups, out / 8], the zero codes packed the same way; ``scales`` [groups, out]. Every AWQ
checkpoint has zero points (``zero_point: true``); the GEMV and other kernel-specific layouts
are refused.
"""

from __future__ import annotations

import torch

from conveyor.worker.layers.quantization.base import (
    CheckpointFormat,
    UnsupportedQuantization,
    check_bits,
)
from conveyor.worker.layers.quantization.packing import AWQ_ORDER, pack_nibbles, unpack_int32
from conveyor.worker.layers.quantization.scheme import INT, LinearScheme, WeightScheme


class AWQ(CheckpointFormat):
    name = "awq"
    markers = ("qweight",)

    def __init__(self, config) -> None:
        super().__init__(config)
        bits = int(config.get("bits", config.get("w_bit", 4)))
        check_bits("awq", bits, (4,))
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedQuantization(f"awq version {version!r}: conveyor reads 'gemm'")
        if not config.get("zero_point", True):
            raise UnsupportedQuantization("awq without zero points (zero_point: false)")
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        self.scheme = LinearScheme(
            WeightScheme(
                INT, bits, group_size=0 if group_size == -1 else group_size, symmetric=False
            )
        )

    def scheme_for(self, module: str) -> LinearScheme:
        return self.scheme

    def translate(self, module: str, suffix: str, tensor: torch.Tensor):
        if suffix == "qweight":
            codes = unpack_int32(tensor, 4, dim=1, order=AWQ_ORDER).T.contiguous()
            yield "quant.codes", pack_nibbles(codes)
        elif suffix == "qzeros":
            zeros = unpack_int32(tensor, 4, dim=1, order=AWQ_ORDER).T.float()
            yield "quant.zeros", zeros.contiguous()
        elif suffix == "scales":
            yield "quant.scales", tensor.T.float().contiguous()
        else:
            yield suffix, tensor  # the bias
