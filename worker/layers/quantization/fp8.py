"""FP8 checkpoints (``quant_method: fp8``, as Qwen3-*-FP8 and DeepSeek publish them).

Runs in worker processes. Each linear's ``weight`` is float8_e4m3fn with either block-wise
scales, ``weight_scale_inv`` [ceil(out / 128), ceil(in / 128)] for ``weight_block_size``
[128, 128] (the name notwithstanding, the weight is ``fp8 * weight_scale_inv``), or one
``weight_scale`` per tensor (with ``input_scale`` where ``activation_scheme`` is static).
Activations are rounded through FP8 as vLLM runs these checkpoints: per 128 features of a token
(block-wise), per tensor (dynamic), or by the checkpoint's input scale (static).
"""

from __future__ import annotations

import torch

from conveyor.worker.layers.quantization.base import CheckpointFormat, UnsupportedQuantization
from conveyor.worker.layers.quantization.scheme import (
    FLOAT8,
    ActivationScheme,
    LinearScheme,
    WeightScheme,
)


class FP8(CheckpointFormat):
    name = "fp8"
    markers = ("weight_scale_inv", "weight_scale")

    def __init__(self, config) -> None:
        super().__init__(config)
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise UnsupportedQuantization(f"fp8 with fmt {fmt!r}: conveyor reads e4m3")
        dynamic = config.get("activation_scheme", "dynamic") == "dynamic"
        block = config.get("weight_block_size")
        if block is not None:
            if not dynamic:
                raise UnsupportedQuantization("fp8 block-wise weights with static activations")
            rows, cols = (int(b) for b in block)
            weights = WeightScheme(FLOAT8, 8, group_size=cols, block_rows=rows)
            activations = ActivationScheme(FLOAT8, "group", True, cols)
        else:
            weights = WeightScheme(FLOAT8, 8)
            activations = ActivationScheme(FLOAT8, "tensor", dynamic)
        self.scheme = LinearScheme(weights, activations)

    def scheme_for(self, module: str) -> LinearScheme:
        return self.scheme

    def translate(self, module: str, suffix: str, tensor: torch.Tensor):
        if suffix == "weight":
            if tensor.dtype != torch.float8_e4m3fn:
                raise UnsupportedQuantization(f"{module}.weight is {tensor.dtype}, not fp8 e4m3")
            yield "quant.codes", tensor
        elif suffix in ("weight_scale_inv", "weight_scale"):
            scale = tensor.float()
            yield "quant.scales", scale.reshape(1, 1) if scale.numel() == 1 else scale
        elif suffix == "input_scale":
            if not self.scheme.activations.dynamic:
                yield "quant.input_scale", tensor.float().reshape(1, 1)
        else:
            yield suffix, tensor
