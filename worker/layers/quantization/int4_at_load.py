"""``--quantization int4``: a float checkpoint's decoder linears turned into 4-bit weights at load.

Runs in worker processes. Each column- and row-parallel linear's weight becomes 4-bit codes with
one symmetric scale per group of 64 input features (32 where 64 does not divide the rank's
inputs, else one per row), the layout a W4A16 checkpoint loads into, so the same compiled
kernel (int4_kernel.py) runs it: 4.5 bits per weight with the float32 scales. The LM head gets a
4-bit copy the same way (its logits read it; a tied embedding keeps the float table for its
lookups), as llama.cpp's 4-bit files quantize theirs: at one request the head is the largest
matrix a step reads (Qwen3-0.6B's tied 151,936 x 1,024 is 622 MB in float32, more than all its
decoder linears in 4 bits). Embeddings and norms stay in the model's dtype; mixture-of-experts
experts are refused (int8 covers them).
"""

from __future__ import annotations

import logging

from torch import nn

from conveyor.worker.layers.quantization.int4_kernel import (
    Int4Panels,
    kernel_takes_groups,
    load_int4_gemm,
    quantize_int4,
)
from conveyor.worker.layers.quantization.packing import pack_nibbles
from conveyor.worker.layers.quantization.scheme import INT, LinearScheme, WeightScheme

logger = logging.getLogger(__name__)

GROUP_SIZES = (64, 32)


def quantize_model_int4(model: nn.Module) -> None:
    from conveyor.worker.layers.fused_moe import MoEExperts
    from conveyor.worker.layers.linear import ColumnParallelLinear, RowParallelLinear

    if any(isinstance(m, MoEExperts) for m in model.modules()):
        raise ValueError(
            "--quantization int4 does not quantize mixture-of-experts experts; use int8, or a "
            "4-bit checkpoint of a dense model"
        )
    layers = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    before = after = 0
    for layer in layers:
        weight = layer.weight.detach()
        in_features = weight.shape[1]
        group = next((g for g in GROUP_SIZES if in_features % g == 0), in_features)
        codes, scales, _ = quantize_int4(weight, group)
        before += weight.nbytes
        scheme = LinearScheme(WeightScheme(INT, 4, group_size=0 if group == in_features else group))
        layer.use_quantized_weights(scheme)
        layer.quant.codes.data = pack_nibbles(codes)
        layer.quant.scales.data = scales
        after += layer.quant.codes.nbytes + scales.nbytes
    gemm = load_int4_gemm()
    head = getattr(model, "lm_head", None)
    hidden = head.weight.shape[1] if head is not None else 0
    group = next((g for g in GROUP_SIZES if hidden and hidden % g == 0), hidden)
    if gemm is not None and head is not None and kernel_takes_groups(hidden, group):
        head.quantized = Int4Panels(gemm, *quantize_int4(head.weight.detach(), group), group)
        head.packed_weight = None
        before += head.weight.nbytes
        after += head.quantized.nbytes
    logger.info(
        "int4 weights for %d layers: %.1f MB -> %.1f MB (%s)",
        len(layers),
        before / 1e6,
        after / 1e6,
        f"kernel {gemm.path.name}" if gemm else "torch ops, no kernel",
    )
