"""GPTQ checkpoints (``quant_method: gptq``, as AutoGPTQ, GPTQModel and optimum write them).

Runs in worker processes. Per linear: ``qweight`` int32 [in * bits / 32, out], the codes packed
along the input dimension (lowest bits first); ``scales`` [groups, out]; ``qzeros`` int32
[groups, out * bits / 32], the zero codes packed along the output dimension; ``g_idx`` [in], each
input feature's group. The original (v1) checkpoint format stores each zero minus one; v2
(``checkpoint_format: gptq_v2``) stores it as is. With ``desc_act`` the features were quantized
in order of importance, so a group's features are scattered and g_idx says which is whose.
"""

from __future__ import annotations

import torch

from conveyor.worker.layers.quantization.base import (
    CheckpointFormat,
    UnsupportedQuantization,
    check_bits,
)
from conveyor.worker.layers.quantization.packing import pack_nibbles, unpack_int32
from conveyor.worker.layers.quantization.scheme import INT, LinearScheme, WeightScheme


class GPTQ(CheckpointFormat):
    name = "gptq"
    markers = ("qweight",)

    def __init__(self, config) -> None:
        super().__init__(config)
        bits = int(config.get("bits", 4))
        check_bits("gptq", bits)
        if config.get("dynamic"):
            raise UnsupportedQuantization(
                "gptq with per-module overrides ('dynamic' in quantization_config) is not run"
            )
        checkpoint_format = config.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise UnsupportedQuantization(f"gptq checkpoint_format {checkpoint_format!r}")
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0
        group_size = int(config.get("group_size", 128))
        self.scheme = LinearScheme(
            WeightScheme(
                INT,
                bits,
                group_size=0 if group_size == -1 else group_size,
                symmetric=bool(config.get("sym", True)),
                act_order=bool(config.get("desc_act", False)),
            )
        )

    def scheme_for(self, module: str) -> LinearScheme:
        return self.scheme

    def translate(self, module: str, suffix: str, tensor: torch.Tensor):
        w = self.scheme.weights
        if suffix == "qweight":
            codes = unpack_int32(tensor, w.bits, dim=0).T.contiguous()
            yield "quant.codes", pack_nibbles(codes) if w.bits == 4 else codes
        elif suffix == "scales":
            yield "quant.scales", tensor.T.float().contiguous()
        elif suffix == "qzeros" and not w.symmetric:
            zeros = unpack_int32(tensor, w.bits, dim=1).T.float() + self.zero_offset
            yield "quant.zeros", zeros.contiguous()
        elif suffix == "g_idx" and w.act_order:
            yield "quant.g_idx", tensor.to(torch.int32)
        elif suffix not in ("qzeros", "g_idx"):
            yield suffix, tensor  # the bias
