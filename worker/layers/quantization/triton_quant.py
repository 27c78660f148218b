"""Quantized linears on CUDA: one Triton GEMM for every weight format, and FP8 x FP8 through
``torch._scaled_mm`` where the GPU multiplies FP8.

Runs in worker processes. The weights stay in the layout every format loads into (scheme.py):
the kernel (triton_quant_kernels.py) reads the 4-bit nibble pairs, 8-bit codes or FP8 weights
and their scales and zeros where they are, so ``dequantized`` needs no second copy. Once the
weights are in, ``make_plan`` decides on the host what each matmul will do (tile depth, the
group index where groups do not fit tiles, the static input scales' parts), so a matmul reads no
device value on the host and its launches depend on shapes alone: it can sit in a CUDA graph.

- Weight-only (W4A16, W8A16, FP8 weights with float activations): when a tile's depth divides
  the group size (or there is one scale per row), the tensor cores multiply the activations by
  the exact ``codes - zero`` and each tile's sum is scaled in float32, so only the activations'
  own dtype rounds anything. Act-order weights have their input features sorted by group once
  at load (``sort_act_order_groups``; each matmul gathers the input in that order) and then run
  as group-wise ones; groups that are not whole runs, and groups no tile depth divides, read
  each feature's group and round the dequantized tile to the activations' dtype.
- Quantized activations (W8A8 int8 or FP8): the activations are rounded to codes exactly as the
  torch path rounds them (activations.py); codes on both sides go through the tensor cores as
  float16 (every int8 and e4m3 value is one), products exact, and the tile's sum takes both
  scales. FP8 weights with one scale per row and FP8 activations per token or per tensor take
  ``torch._scaled_mm`` on a GPU of compute capability 8.9 or more (FP8 tensor cores), scaled
  after in float32. Act-order weights with quantized activations multiply the fake-quantized
  activations in float32.

Where Triton is missing or ``CONVEYOR_QUANT_KERNEL=0``, and after a launch that raised (logged
once), the torch path of weights.py runs. The CPU tests run the kernel in Triton's interpreter
(tests/worker/test_triton_quant.py); scripts/compile_triton_sm90.py compiles it for sm_90.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from conveyor.worker.layers.quantization.activations import (
    fake_quantize,
    quantize,
    quantize_activations,
)
from conveyor.worker.layers.quantization.packing import pack_nibbles, unpack_nibbles
from conveyor.worker.layers.quantization.scheme import FLOAT8
from conveyor.worker.layers.triton_ops import device_failure

if TYPE_CHECKING:
    from conveyor.worker.layers.quantization.weights import QuantizedWeights

logger = logging.getLogger(__name__)

# Off (0, false, no, off) keeps the torch path on CUDA: for comparison and as a way out.
KERNEL_ENV = "CONVEYOR_QUANT_KERNEL"
# Tile depths tried, deepest first: the first that divides the group size is used.
BLOCK_KS = (64, 32, 16)
# FP8 tensor cores: Ada (8.9) and Hopper (9.0) on.
FP8_CAPABILITY = (8, 9)

# Why the kernels stopped being used in this process (a launch raised); None while they work.
# The first forward is the memory profile's, eager, so a failure shows there, before any graph.
failure: str | None = None
# The same for torch._scaled_mm alone: the Triton kernel takes its matmuls after one raised.
scaled_mm_failure: str | None = None


@functools.cache
def kernels_enabled() -> bool:
    """CONVEYOR_QUANT_KERNEL (a value that is neither on nor off is refused at load)."""
    from conveyor.worker.kv_cache import switch_from_env  # kv_cache imports the layers

    return switch_from_env(KERNEL_ENV)


def unavailable_reason() -> str | None:
    """Why CUDA quantized linears cannot take the kernels (None: they can), for the log."""
    from conveyor.worker.attention.triton_backend import triton_import_error

    if failure is not None:
        return f"a launch failed ({failure})"
    if not kernels_enabled():
        return f"{KERNEL_ENV} turns the quantized kernels off"
    import_error = triton_import_error()
    if import_error is not None:
        return f"triton does not import ({import_error})"
    return None


@functools.cache
def _log_unavailable(reason: str) -> None:
    logger.warning("quantized linears on CUDA dequantize with torch ops: %s", reason)


@dataclass(frozen=True)
class StaticPart:
    """Output rows [start, end) whose input the checkpoint's static ``scale`` quantizes."""

    start: int
    end: int
    scale: torch.Tensor  # float32 [1, 1] on the weights' device


@dataclass(frozen=True)
class KernelPlan:
    """What every matmul of one quantized linear does, decided once after loading."""

    # int64 [in]: the order the input's features are gathered in (act-order weights sorted by
    # group: ``sort_act_order_groups``); None: as they come.
    input_order: torch.Tensor | None
    block_k: int
    # Input features per scale along a tile (in_features: one scale per row); 0 with g_idx.
    group_size: int
    # int32 [in]: each feature's scale column, where act-order or the groups' size need it.
    g_idx: torch.Tensor | None
    zero_point: float  # a symmetric format's zero code (0 for FP8 weights)
    # Whether quantized activations' scales fit the tiles (their group a multiple of block_k).
    activation_tiles: bool
    scaled_mm: bool  # FP8 x FP8 through torch._scaled_mm
    static_parts: tuple[StaticPart, ...] = ()
    one: torch.Tensor | None = None  # float32 1.0: _scaled_mm's scales (ours apply after)


def make_plan(weights: QuantizedWeights, fp8_matmul: bool | None = None) -> KernelPlan | None:
    """The plan for ``weights`` (None, logged once, where the kernels are unavailable);
    ``fp8_matmul``: whether the device multiplies FP8 (default: asked of the device)."""
    reason = unavailable_reason()
    if reason is not None:
        _log_unavailable(reason)
        return None
    w, a = weights.scheme.weights, weights.scheme.activations
    device = weights.scales.device
    in_features = weights.in_features
    group = w.group_size or in_features
    block_k = next((b for b in BLOCK_KS if group % b == 0), 0) if w.group_size else BLOCK_KS[0]
    g_idx = None
    if (w.act_order and weights.input_order is None) or block_k == 0:
        g_idx = weights.group_of_each_input().to(device=device, dtype=torch.int32)
        block_k, group = BLOCK_KS[0], 0
    activation_tiles = a is None or a.strategy != "group" or a.group_size % block_k == 0
    if fp8_matmul is None:
        fp8_matmul = device.type == "cuda" and _fp8_matmul_works(device)
    parts = _static_parts(weights) if a is not None and not a.dynamic else ()
    # _scaled_mm multiplies FP8 with one scale per operand (ours apply after): per-row weight
    # scales, per-token or per-tensor activations, and every matrix side a multiple of 16.
    part_sizes = [p.end - p.start for p in parts] or [weights.out_features]
    scaled_mm = (
        fp8_matmul
        and w.kind == FLOAT8
        and w.group_size == 0
        and a is not None
        and a.kind == FLOAT8
        and a.strategy in ("token", "tensor")
        and in_features % 16 == 0
        and all(size % 16 == 0 for size in part_sizes)
    )
    return KernelPlan(
        input_order=weights.input_order,
        block_k=block_k,
        group_size=group,
        g_idx=g_idx,
        zero_point=0.0 if w.kind == FLOAT8 else float(w.middle_code),
        activation_tiles=activation_tiles and g_idx is None,
        scaled_mm=scaled_mm,
        static_parts=parts,
        one=torch.ones((), dtype=torch.float32, device=device) if scaled_mm else None,
    )


@functools.cache
def _fp8_matmul_works(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` multiplies FP8 on ``device`` as we call it (one row, a
    float32 output): tried once at load, so that a torch or GPU without it is found before any
    CUDA graph is captured, where a failure could not fall back."""
    if torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        return False
    one = torch.ones((), dtype=torch.float32, device=device)
    codes = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(codes[:1], codes.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except RuntimeError as error:
        logger.warning("torch._scaled_mm fails here (%s); FP8 x FP8 takes the Triton kernel", error)
        return False
    return True


def sort_act_order_groups(weights: QuantizedWeights) -> None:
    """Reorder act-order weights' input features by group, once, where each group is then a
    whole run of ``group_size`` features (GPTQ's desc_act always is): the codes' columns and
    g_idx are permuted in place and ``weights.input_order`` keeps the order, which each matmul
    gathers the input by. The tiles then hold one group each (one scale per output, the exact
    codes through the tensor cores) instead of gathering a scale per weight. Not where the
    activations are quantized per group of features: their groups are the input's own order."""
    w, a = weights.scheme.weights, weights.scheme.activations
    if not w.act_order or weights.input_order is not None or (a and a.strategy == "group"):
        return
    groups = weights.g_idx.data.long()
    order = torch.argsort(groups, stable=True)
    runs = torch.arange(weights.in_features, device=groups.device) // w.group_size
    if not torch.equal(groups[order], runs):  # groups of other sizes: the kernel gathers
        return
    codes = unpack_nibbles(weights.codes.data) if w.bits == 4 else weights.codes.data
    codes = codes[:, order]
    weights.codes.data = pack_nibbles(codes) if w.bits == 4 else codes.contiguous()
    weights.g_idx.data = groups[order].to(torch.int32)
    weights.input_order = order


def _static_parts(weights: QuantizedWeights) -> tuple[StaticPart, ...]:
    """Runs of output rows that share the checkpoint's input scale (q, k and v have one each),
    read on the host once, here, so that no matmul reads them."""
    values = weights.input_scale[:, 0].tolist()
    parts, start = [], 0
    for row in range(1, len(values) + 1):
        if row == len(values) or values[row] != values[start]:
            scale = weights.input_scale[start : start + 1].to(torch.float32)
            parts.append(StaticPart(start, row, scale))
            start = row
    return tuple(parts)


def linear(
    weights: QuantizedWeights, plan: KernelPlan, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x W^T (+ bias) in x's dtype; None (logged once, the torch path from then on) if a
    launch raised."""
    global failure
    rows = x.reshape(-1, weights.in_features)
    if plan.input_order is not None:
        rows = rows.index_select(1, plan.input_order)  # the codes' feature order
    elif rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weights.out_features, dtype=x.dtype, device=x.device)
    try:
        if rows.shape[0]:
            _matmul(weights, plan, rows, bias, out)
    except Exception as error:  # noqa: BLE001 - a kernel that cannot be built or launched
        if device_failure(error):
            raise
        failure = f"{type(error).__name__}: {error}"
        logger.warning("quantized kernels off, dequantizing with torch ops: %s", failure)
        return None
    return out.view(*x.shape[:-1], weights.out_features)


def _matmul(
    weights: QuantizedWeights,
    plan: KernelPlan,
    rows: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    a = weights.scheme.activations
    if a is None:
        _gemm(weights, plan, rows, out, bias)
    elif not a.dynamic:
        for part in plan.static_parts:
            span = slice(part.start, part.end)
            part_bias = None if bias is None else bias[span]
            codes = quantize(rows.float(), part.scale, a.kind)
            if plan.scaled_mm and _scaled_mm(
                weights, plan, codes, part.scale, out, part_bias, span
            ):
                continue
            _gemm(weights, plan, codes.half(), out, part_bias, part.scale, rows.shape[1], span)
    elif plan.activation_tiles:
        codes, scales = quantize_activations(rows.float(), a.kind, a.strategy, a.group_size)
        if plan.scaled_mm and _scaled_mm(weights, plan, codes, scales, out, bias):
            return
        x_group = a.group_size if a.strategy == "group" else rows.shape[1]
        _gemm(weights, plan, codes.half(), out, bias, scales, x_group)
    else:  # scales that change inside a tile: the float32 activations they mean
        x = fake_quantize(rows.float(), a.kind, a.strategy, a.group_size)
        _gemm(weights, plan, x, out, bias)


def tile_for(num_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) by the step's row count: a decode's few rows in one 16-row
    tile with narrow column blocks (a 4,096-wide matrix gives 128 programs, about one per SM
    of an H100/H200, for a step that only streams the weights), a prompt chunk's thousands in
    128 x 128 tiles that reuse each weight tile over many rows. Chosen, not yet measured."""
    if num_rows <= 16:
        return 16, 32, 4
    if num_rows <= 64:
        return 64, 64, 4
    return 128, 128, 8


def _gemm(
    weights: QuantizedWeights,
    plan: KernelPlan,
    x: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    x_scales: torch.Tensor | None = None,
    x_group: int = 0,
    span: slice = slice(None),
) -> None:
    """out[:, span] = x W[span]^T (+ bias), W's rows ``span`` (views: no copy)."""
    from conveyor.worker.layers.quantization import triton_quant_kernels as kernels

    codes, scales = weights.codes[span], weights.scales[span]
    float8 = codes.dtype == torch.float8_e4m3fn
    codes = codes.view(torch.uint8)  # the kernel reads FP8 bytes and converts them itself
    zeros = weights.zeros[span] if "zeros" in weights._parameters else None
    target = out[:, span]
    num_rows, in_features = x.shape
    out_features = codes.shape[0]
    if x_scales is not None:
        x_scales = x_scales.expand(num_rows, x_scales.shape[1])
    block_m, block_n, warps = tile_for(num_rows)
    grid = (-(-num_rows // block_m), -(-out_features // block_n))
    kernels.quant_gemm[grid](
        x, scales if x_scales is None else x_scales, codes, scales,
        scales if zeros is None else zeros, codes if plan.g_idx is None else plan.g_idx,
        scales if bias is None else bias, target,
        num_rows, out_features, in_features,
        x.stride(0), *(x_scales.stride() if x_scales is not None else (0, 0)),
        codes.stride(0), scales.stride(0), 0 if zeros is None else zeros.stride(0),
        target.stride(0), max(plan.group_size, 1), max(x_group, 1), plan.zero_point,
        W_BITS=weights.scheme.weights.bits, W_FLOAT8=float8,
        HAS_ZEROS=zeros is not None, GATHER=plan.g_idx is not None,
        X_SCALED=x_scales is not None, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=plan.block_k, num_warps=warps,
    )  # fmt: skip


def _scaled_mm(
    weights: QuantizedWeights,
    plan: KernelPlan,
    codes: torch.Tensor,
    x_scales: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    span: slice = slice(None),
) -> bool:
    """out[:, span] = (codes W_codes[span]^T) * x_scales * w_scales (+ bias) with FP8 tensor
    cores summing in float32; False (logged once, the Triton kernel from then on) if it raised."""
    global scaled_mm_failure
    if scaled_mm_failure is not None:
        return False
    try:
        summed = torch._scaled_mm(
            codes.to(torch.float8_e4m3fn),
            weights.codes[span].t(),
            scale_a=plan.one,
            scale_b=plan.one,
            out_dtype=torch.float32,
        )
    except RuntimeError as error:  # a torch or device without this FP8 matmul
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        scaled_mm_failure = f"{type(error).__name__}: {error}"
        logger.warning(
            "torch._scaled_mm failed (%s); the Triton kernel runs FP8", scaled_mm_failure
        )
        return False
    result = summed * x_scales * weights.scales[span, 0]
    if bias is not None:
        result = result + bias.to(torch.float32)
    out[:, span] = result
    return True
