"""The small token-wise ops of a decoder layer as one Triton kernel each, on CUDA.

Runs in worker processes. Between its four matmuls and attention, a Qwen3 layer ran about twenty
torch kernels on CUDA: the residual add and RMSNorm as five (add, cast up, norm, cast down,
scale), twice, q/k norm and RoPE as nine, SiLU times up as two. Inside a whole-forward CUDA graph
each still costs the GPU 1-3 us however little it does: measured on an H200, they were 44 % of a
decode step's kernel time at batch 64. Here each group is one kernel:

- ``add_rms_norm``: (x + residual, norm of it) in one pass, or the norm alone;
- ``qk_norm_rope_``: every query and key head of the step normalised and rotated in place;
- ``silu_and_mul``: silu(gate) * up.

Each rounds to the activation dtype where the torch ops do, so bfloat16 results match them (and
transformers) rather than drifting. The layers call these on CUDA tensors when Triton imports and
``CONVEYOR_TRITON_OPS`` is not ``0``; everything else keeps the torch ops (and the CPU its
compiled ops, worker/layers/cpu_ops.py), and so does every layer after a launch that raised (a
WARNING names it). The CPU tests run the same kernels through Triton's
interpreter against the torch ops (tests/worker/test_triton_ops.py).
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

TRITON_OPS_ENV = "CONVEYOR_TRITON_OPS"

# Why the kernels stopped being used in this process (a launch raised: a Triton that cannot
# compile them, say); None while they work. The first forward is the memory profile's, eager,
# so a failure shows there, before any CUDA graph is captured, and every later call keeps the
# torch ops.
failure: str | None = None


@functools.cache
def triton_ops_enabled() -> bool:
    """Whether CUDA layers use these kernels: Triton imports and CONVEYOR_TRITON_OPS does not
    turn them off (a value that is neither on nor off is refused, at the first CUDA forward:
    the memory profile's, at start-up)."""
    # Imported here: the attention package imports the layers.
    from conveyor.worker.attention.triton_backend import triton_import_error
    from conveyor.worker.kv_cache import switch_from_env

    if not switch_from_env(TRITON_OPS_ENV):
        return False

    return triton_import_error() is None


def use_triton_ops(x: torch.Tensor) -> bool:
    return x.is_cuda and failure is None and triton_ops_enabled()


def device_failure(error: Exception) -> bool:
    """Whether a failed Triton launch must be raised, not answered by a fallback to torch ops:
    a CUDA error is the device's, not the kernel's build (the next op would fail too), and a
    graph capture in progress is broken by any failure."""
    return "CUDA error" in str(error) or (
        torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    )


def _launch(name: str, grid: tuple[int, ...], *args, **meta) -> bool:
    """Run kernel ``name``; False (logged once, the kernels off from then on) if it raises, so
    the caller falls back to the torch ops."""
    global failure
    try:
        from conveyor.worker.layers import triton_token_kernels

        getattr(triton_token_kernels, name)[grid](*args, **meta)
    except Exception as error:  # noqa: BLE001 - a kernel that cannot be built or launched
        if device_failure(error):
            raise
        failure = f"{name}: {type(error).__name__}: {error}"
        logger.warning("Triton token ops off, using torch ops: %s", failure)
        return False
    return True


def _block(size: int) -> int:
    return max(16, 1 << (size - 1).bit_length())


def _warps(block: int) -> int:
    # About 8 elements a thread; 1 warp for a head, up to 16 for an 8k-wide row.
    return min(16, max(1, block // 256))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """x, residual [..., size] (last dim contiguous) -> (norm(x + residual), x + residual), or
    (norm(x), None) without a residual: RMSNorm.forward's contract, new tensors. None if the
    kernel cannot run (see ``failure``)."""
    size = x.shape[-1]
    rows = x.reshape(-1, size)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    summed = None
    res_rows = rows
    if residual is not None:
        res_rows = residual.reshape(-1, size)
        summed = torch.empty_like(out)
    block = _block(size)
    if rows.shape[0] and not _launch(
        "add_rms_norm",
        (rows.shape[0],),
        rows,
        res_rows,
        weight,
        out,
        summed if summed is not None else out,
        rows.stride(0),
        res_rows.stride(0),
        out.stride(0),
        out.stride(0),
        eps,
        SIZE=size,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=_warps(block),
    ):
        return None
    out = out.view(x.shape)
    return out, None if summed is None else summed.view(x.shape)


def qk_norm_rope_(
    qk: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor | None:
    """qk [T, heads, head_dim] (each head contiguous; a view into the qkv output is fine): each
    head normalised times its ``weight`` row [heads, head_dim] (skipped when None), then rotated
    by cos, sin [T, 1, half] (neox style, the first 2 * half dims), in place; returns qk, or
    None, untouched, if the kernel cannot run."""
    num_tokens, num_heads, head_dim = qk.shape
    half = cos.shape[-1]
    rest = head_dim - 2 * half
    if num_tokens and not _launch(
        "qk_norm_rope",
        (num_tokens, num_heads),
        qk,
        weight if weight is not None else qk,
        cos,
        sin,
        qk.stride(0),
        qk.stride(1),
        cos.stride(0),
        sin.stride(0),
        eps,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_HALF=_block(half),
        REST=rest,
        BLOCK_REST=_block(max(rest, 1)),
        HAS_WEIGHT=weight is not None,
        num_warps=1,
    ):
        return None
    return qk


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """x [..., 2 * size] = [gate | up] (last dim contiguous) -> silu(gate) * up [..., size];
    None if the kernel cannot run."""
    size = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * size)
    out = torch.empty((rows.shape[0], size), dtype=x.dtype, device=x.device)
    block = min(_block(size), 1024)
    grid = (rows.shape[0], -(-size // block))
    meta = {"SIZE": size, "BLOCK": block, "num_warps": 4}
    if rows.shape[0] and not _launch(
        "silu_and_mul", grid, rows, out, rows.stride(0), out.stride(0), **meta
    ):
        return None
    return out.view(*x.shape[:-1], size)
