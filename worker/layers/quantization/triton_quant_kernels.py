"""The Triton GEMM behind worker/layers/quantization/triton_quant.py (that module says when and
how it runs).

A module of its own so that importing the quantized layers never needs Triton: this one is
imported on the first CUDA matmul of a quantized linear. Triton's interpreter (TRITON_INTERPRET=1,
the CPU tests) patches ``tl`` in the kernels' module globals, so the kernel lives at a module's
top level.
"""

import triton
import triton.language as tl


@triton.jit
def quant_gemm(
    x_ptr,
    x_scales_ptr,
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    g_idx_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_xsg,
    stride_cn,
    stride_sn,
    stride_zn,
    stride_om,
    group_size,
    x_group_size,
    zero_point,
    W_BITS: tl.constexpr,
    W_FLOAT8: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    GATHER: tl.constexpr,
    X_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), summed in float32, rounded once to out's
    dtype; w[n, k] = (codes[n, k] - zero[n, g]) * scale[n, g] with g the group of feature k.

    codes: [N, K / 2] uint8 nibble pairs (the even feature low) when W_BITS is 4, else [N, K]
    uint8: integer codes, or float8_e4m3fn bytes (W_FLOAT8). Tiled (GATHER false): BLOCK_K divides ``group_size``, so each tile
    of K shares one scale and zero per output: the tensor cores multiply x by the exact
    ``codes - zero`` and the scale multiplies the tile's sum. GATHER: ``g_idx`` [K] gives each
    feature's group (act-order, or groups no tile fits); the tile is dequantized in float32 and
    rounded to x's dtype for the dot. X_SCALED: x holds quantized activations' codes and
    ``x_scales`` [M, K / x_group_size] their scales, constant over a tile like the weights'.
    """
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_ok = k_ok[:, None] & col_ok[None, :]
        if W_BITS == 4:
            pairs = tl.load(
                codes_ptr + cols[None, :] * stride_cn + (ks // 2)[:, None], mask=w_ok, other=0
            )
            codes = ((pairs >> ((ks % 2) * 4).to(tl.uint8)[:, None]) & 0xF).to(tl.float32)
        else:
            codes = tl.load(codes_ptr + cols[None, :] * stride_cn + ks[:, None], mask=w_ok, other=0)
            if W_FLOAT8:  # e4m3 bytes, passed as uint8
                codes = codes.to(tl.float8e4nv, bitcast=True)
            codes = codes.to(tl.float32)
        if GATHER:
            groups = tl.load(g_idx_ptr + ks, mask=k_ok, other=0)
            # Zero scales outside the matrix: no garbage (a NaN) times a masked-off zero input.
            scales = tl.load(
                scales_ptr + cols[None, :] * stride_sn + groups[:, None], mask=w_ok, other=0.0
            )
            if HAS_ZEROS:
                zeros = tl.load(
                    zeros_ptr + cols[None, :] * stride_zn + groups[:, None], mask=w_ok, other=0.0
                )
                weights = (codes - zeros) * scales
            else:
                weights = (codes - zero_point) * scales
            acc += tl.dot(x, weights.to(x.dtype), input_precision=PRECISION)
        else:
            group = k0 // group_size
            scales = tl.load(scales_ptr + cols * stride_sn + group, mask=col_ok, other=0.0)
            if HAS_ZEROS:
                zeros = tl.load(zeros_ptr + cols * stride_zn + group, mask=col_ok, other=0.0)
                weights = codes - zeros[None, :]
            else:
                weights = codes - zero_point
            part = tl.dot(x, weights.to(x.dtype), input_precision=PRECISION)
            if X_SCALED:
                x_scales = tl.load(
                    x_scales_ptr + rows * stride_xsm + (k0 // x_group_size) * stride_xsg,
                    mask=row_ok,
                    other=0.0,
                )
                acc += part * x_scales[:, None] * scales[None, :]
            else:
                acc += part * scales[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )
