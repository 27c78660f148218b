"""The Triton kernels behind worker/layers/triton_ops.py (that module says what they are for).

A module of its own so that importing the layers never needs Triton: this one is imported on the
first call. Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) patches ``tl`` in the
kernels' module globals, so the kernels live at a module's top level.

Each kernel rounds to the activation dtype where the torch ops it replaces do (``_round``
between steps is a no-op in float32), so bfloat16 results match those ops, not a more exact
float32 pipeline that would drift from transformers' numbers.
"""

import triton
import triton.language as tl

# bfloat16 and float16 are rounded by hand, to nearest even, on every target: Triton's
# interpreter (the CPU tests) truncates bfloat16 where a GPU rounds, and compiled for an H200 a
# plain round trip through bfloat16 ahead of an add was contracted away (the sum took the
# unrounded product: about a quarter of qk_norm_rope's second halves came out an ulp off the
# torch ops). Integer ops on the bits cannot be contracted, so the tests and the GPU see the
# torch ops' numbers; the conversion after them is exact.


@triton.jit
def _to(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to ``dtype``, to nearest even, NaN kept NaN."""
    return _on_grid(x, dtype).to(dtype)


@triton.jit
def _on_grid(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to nearest even onto ``dtype``'s values, still in float32 (past
    float16's largest value: 65,536 or more, which converts to infinity)."""
    y = x
    if dtype == tl.bfloat16:
        # Half an ulp (less one when the kept last bit is even) carries into the kept half
        # exactly when rounding up is due. A NaN's bits could carry into the sign or lose their
        # payload to an infinity, so any NaN becomes the quiet one.
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        y = tl.where(x != x, float("nan"), bits.to(tl.float32, bitcast=True))
    elif dtype == tl.float16:
        # float16 keeps 10 of float32's 23 fraction bits: the same carry, 13 bits down, for
        # normal values (past 65,504 it lands on 65,536 or more, which converts to infinity, as
        # rounding should). Below 2**-14 float16's steps are 2**-24 whatever the exponent:
        # adding and taking away 0.5, where float32's step is 2**-24, rounds to them.
        raw = x.to(tl.uint32, bitcast=True)
        bits = ((raw + 0xFFF + ((raw >> 13) & 1)) >> 13) << 13
        normal = bits.to(tl.float32, bitcast=True)
        magnitude = tl.abs(x)
        tiny = (magnitude + 0.5) - 0.5
        tiny = tl.where((raw >> 31) != 0, -tiny, tiny)  # the sign bit: -0.0 stays -0.0
        y = tl.where(magnitude < 2.0**-14, tiny, normal)
        y = tl.where(x != x, float("nan"), y)
    return y


@triton.jit
def _round(x, dtype: tl.constexpr):
    """``x`` as the torch op before would leave it: rounded to ``dtype``, back in float32."""
    return _to(x, dtype).to(tl.float32)


@triton.jit
def add_rms_norm(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    eps,
    SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """One row: s = x + residual (stored, rounded), then weight * (s / rms(s)), rounded like
    Hugging Face's RMSNorm: normalised in float32, cast, then scaled in the activation dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < SIZE
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        summed = _to(x + r, dtype)
        tl.store(sum_ptr + row * stride_s + cols, summed, mask=ok)
        x = summed.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(x * x, 0) / SIZE + eps)
    normalized = _round(x * inverse_rms, dtype)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _to(normalized * weight, dtype), mask=ok)


@triton.jit
def qk_norm_rope(
    qk_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    stride_t,
    stride_h,
    stride_ct,
    stride_st,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    """One head of one token, in place: RMS-normalised times its weight row (with HAS_WEIGHT),
    then its first 2 * HALF dims rotated neox-style by the token's angles; the REST dims after
    them (partial rotary) are only normalised."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dtype = qk_ptr.dtype.element_ty
    base = qk_ptr + token * stride_t + head * stride_h
    half = tl.arange(0, BLOCK_HALF)
    half_ok = half < HALF
    x1 = tl.load(base + half, mask=half_ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + half, mask=half_ok, other=0.0).to(tl.float32)
    rest = tl.arange(0, BLOCK_REST)
    rest_ok = rest < REST
    if REST > 0:
        x3 = tl.load(base + 2 * HALF + rest, mask=rest_ok, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        squares = tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)
        if REST > 0:
            squares += tl.sum(x3 * x3, 0)
        inverse_rms = tl.rsqrt(squares / HEAD_DIM + eps)
        row = weight_ptr + head * HEAD_DIM
        w1 = tl.load(row + half, mask=half_ok, other=0.0).to(tl.float32)
        w2 = tl.load(row + HALF + half, mask=half_ok, other=0.0).to(tl.float32)
        x1 = _round(_round(x1 * inverse_rms, dtype) * w1, dtype)
        x2 = _round(_round(x2 * inverse_rms, dtype) * w2, dtype)
        if REST > 0:
            w3 = tl.load(row + 2 * HALF + rest, mask=rest_ok, other=0.0).to(tl.float32)
            x3 = _to(_round(x3 * inverse_rms, dtype) * w3, dtype)
            tl.store(base + 2 * HALF + rest, x3, mask=rest_ok)
    cos = tl.load(cos_ptr + token * stride_ct + half, mask=half_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + half, mask=half_ok, other=0.0).to(tl.float32)
    # The torch ops' order and roundings: x1 sin, x1 cos - x2 sin, x2 cos + x1 sin.
    x1_sin = _round(x1 * sin, dtype)
    new_x1 = _round(x1 * cos, dtype) - x2 * sin
    new_x2 = _round(x2 * cos, dtype) + x1_sin
    tl.store(base + half, _to(new_x1, dtype), mask=half_ok)
    tl.store(base + HALF + half, _to(new_x2, dtype), mask=half_ok)


@triton.jit
def silu_and_mul(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row's BLOCK columns of silu(gate) * up, x = [gate | up] of SIZE each."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < SIZE
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + SIZE + cols, mask=ok, other=0.0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * stride_o + cols, _to(silu * up, dtype), mask=ok)
