"""The Triton kernels behind worker/lora/triton_lora.py (that module says what they are for).

A module of its own so that importing the LoRA layers never needs Triton: this one is imported on
the first CUDA LoRA step. Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) patches ``tl``
in the kernels' module globals, so the kernels live at a module's top level.
"""

import triton
import triton.language as tl


@triton.jit
def shrink(
    x_ptr,
    a_ptr,
    slots_ptr,
    out_ptr,
    stride_x,
    stride_as,
    stride_ak,
    stride_o,
    K,
    W,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """One token: out[t, :W] = x[t, :K] A_t[slot] in float32 (zeros for the base model's)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, K, BLOCK_K):
            rows = k0 + tl.arange(0, BLOCK_K)
            inputs = tl.load(x_ptr + token * stride_x + rows, mask=rows < K, other=0.0)
            weights = tl.load(
                a_ptr + slot * stride_as + rows[:, None] * stride_ak + cols[None, :],
                mask=(rows[:, None] < K) & (cols[None, :] < W),
                other=0.0,
            )
            acc += tl.sum(inputs.to(tl.float32)[:, None] * weights.to(tl.float32), axis=0)
    tl.store(out_ptr + token * stride_o + cols, acc, mask=cols < W)


@triton.jit
def expand(
    shrunk_ptr,
    b_ptr,
    slots_ptr,
    out_ptr,
    stride_s,
    stride_bs,
    stride_bw,
    stride_o,
    N,
    W,
    BLOCK_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One token's BLOCK_N outputs: out[t, n] += shrunk[t] B[slot][:, n], rounded once."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        outputs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        width = tl.arange(0, BLOCK_W)
        shrunk = tl.load(shrunk_ptr + token * stride_s + width, mask=width < W, other=0.0)
        weights = tl.load(
            b_ptr + slot * stride_bs + width[:, None] * stride_bw + outputs[None, :],
            mask=(width[:, None] < W) & (outputs[None, :] < N),
            other=0.0,
        )
        delta = tl.sum(shrunk[:, None] * weights.to(tl.float32), axis=0)
        where = out_ptr + token * stride_o + outputs
        before = tl.load(where, mask=outputs < N, other=0.0)
        total = before.to(tl.float32) + delta
        tl.store(where, total.to(out_ptr.dtype.element_ty), mask=outputs < N)
