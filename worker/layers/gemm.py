"""y = x W^T + b, with the fastest CPU kernel for the number of rows.

Runs in worker processes. On an AVX2 CPU, MKL's sgemm (what ``F.linear`` calls) is near the
machine's peak for prefill-sized inputs (thousands of rows) but not at decode sizes (one row per
running request), where oneDNN with the weight reordered once into its blocked layout is faster;
where torch runs AVX-512 code, oneDNN's packed path is the faster one at every size (``python -m
benchmarks layers`` measures both per shape). So a layer keeps its plain weight, which the loader,
tensor-parallel slicing and a tied embedding all read, and may hold a packed copy of it next to
it for small batches (for every batch on AVX-512: ``packed_row_limit``). The copy doubles the
layer's weight memory; it is made for float32 and bfloat16 CPU weights, where the measured gain
is. bfloat16 matmuls go through oneDNN at every
size anyway (MKL has none), and the packed weight is faster at every size measured: 2.4-3.6x at
one row, 1.2-1.3x at 64, 1.04-1.09x at 2,048 (2-core Zen 4 with AVX512_BF16, the `bench` model's
shapes), so bfloat16 takes it for every batch.

A float32 linear of one or two rows (a decode step of one or two requests) goes to the compiled
token ops' ``small_linear`` instead, where they are built: it streams the plain weight at ~1.2x
the packed copy's speed there (one or two requests decode 1.07-1.2x as fast end to end). So do
three to eight rows (a few requests, or one request with its speculative positions) where the
weight is small enough to be in cache (SMALL_LINEAR_WIDE_MAX_ELEMENTS): there oneDNN's call
costs more than the product. ``CONVEYOR_SMALL_LINEAR=0`` keeps the packed copy for them all.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from conveyor.worker.layers.cpu_ops import (
    SMALL_LINEAR_MAX_ROWS,
    load_token_ops,
    small_linear_enabled,
)

logger = logging.getLogger(__name__)

# Three to eight rows take ``small_linear`` only for a weight of at most this many elements
# (1 MiB of float32: one core's L2 holds it), where a step finds it in cache and oneDNN's call
# costs more than the product (the default model's linears: 1.1-2x per call). A larger weight
# streams from memory, where oneDNN's packed layout is faster from three rows on (1.1-1.3x on
# the `bench` model's qkv, gate_up and LM head; `python -m benchmarks layers --section small`).
SMALL_LINEAR_WIDE_MAX_ELEMENTS = 1 << 18

# The most rows that go through the packed weight. From bench_layers on a 2-core AVX2 EPYC with
# 2 threads: packed wins by 5-80% at 16-64 rows (the LM head most), is even at 256 (the head still
# +13%) and loses 3-12% at 2048. With 1 thread (tensor parallel over those cores) it is even at 64
# rows: the gain is mostly oneDNN splitting a short matrix better across threads.
PACKED_MAX_ROWS = 256


def packed_row_limit() -> int | None:
    """The most rows a float32 batch sends through the packed weight; None: every batch.

    Where torch runs AVX-512 code, oneDNN's AVX-512 kernels beat MKL's sgemm at every size
    measured (2-core Zen 4, the `bench` model's shapes: 1.11-1.13x at 512 and 2,048 rows, up to
    1.6x at 64), so every batch takes the packed weight there; elsewhere PACKED_MAX_ROWS holds.
    """
    return None if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else PACKED_MAX_ROWS


_ROW_LIMIT = packed_row_limit()
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-packed copy of ``weight`` [out, in] for small batches, or None where none helps.

    None off the CPU, for dtypes other than float32 and bfloat16, and where this torch has no
    oneDNN.
    """
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.dim() != 2:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        # The batch-size hint barely matters (measured 4-256 rows alike), except that 1 is worse.
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_MAX_ROWS // 2)
    except (RuntimeError, AttributeError) as error:  # an op missing from a slimmer build
        logger.info("no packed CPU weights (%s); using sgemm for every batch size", error)
        return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] -> [..., out]; ``packed`` is ``pack_weight(weight)`` or None."""
    if (
        x.dim() == 2
        and x.shape[0] <= SMALL_LINEAR_MAX_ROWS
        and x.dtype == torch.float32
        and (x.shape[0] <= 2 or weight.numel() <= SMALL_LINEAR_WIDE_MAX_ELEMENTS)
    ):
        ops = load_token_ops() if x.is_cpu else None
        if (
            ops is not None
            and small_linear_enabled()
            and (ops.threaded or torch.get_num_threads() == 1)
            and ops.takes_linear(x, weight, bias)
        ):
            return ops.small_linear(x, weight, bias)
    if packed is not None and (
        _ROW_LIMIT is None or x.dtype == torch.bfloat16 or x.numel() <= _ROW_LIMIT * x.shape[-1]
    ):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
