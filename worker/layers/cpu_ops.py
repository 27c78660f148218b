"""Compiled token-wise ops for float32 and bfloat16 on CPU (``csrc/token_ops.c``): the residual
add fused into the RMSNorm that follows it, the q/k head norm fused with the rotation, silu * up,
and in float32 the linears of one to eight rows (``small_linear``, which worker/layers/gemm.py
dispatches to).

Runs in worker processes. Built and cached like the attention kernel (``worker.native``); where
it cannot be built, or ``CONVEYOR_CPU_KERNEL=0``, the layers keep their torch ops. In the `bench`
model's forward the torch add + RMSNorm was 5.8 % of the time (`equal` workload); through the
layer this is 1.7-1.9x faster per call at 64-2,048 rows. The q/k norm with the rotation
replaces a dozen torch ops per layer with one pass while each head is in L1 (2-3x the torch ops
at 64-2,048 rows), silu * up two (1.2-1.3x). In bfloat16, where torch's ops each widen, compute
and round a fresh tensor, the ops round at the same places in one pass: 2-4x, 1.8-3.9x and
1.25-1.45x the torch ops at 64-2,048 rows (one thread, Xeon with AVX512-BF16).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from conveyor.worker import native

logger = logging.getLogger(__name__)

SOURCE_PATH = Path(__file__).parent / "csrc" / "token_ops.c"
# The attention kernel's vector helpers, which the source includes.
VECTOR_MATH_PATH = Path(__file__).parent.parent / "attention" / "csrc" / "vector_math.h"
# Must match CONVEYOR_TOKEN_OPS_ABI_VERSION in the source.
ABI_VERSION = 6
# What the ops take: float32, and bfloat16 rounded where the torch ops round.
DTYPES = (torch.float32, torch.bfloat16)

_i32, _i64, _f32, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ADD_RMS_NORM_ARGTYPES = [
    _ptr, _i64, _ptr, _i64,  # x and its row stride, residual (or NULL) and its row stride
    _ptr, _i64, _i32, _f32,  # weight, rows, size, eps
    _ptr, _i64, _ptr, _i64,  # out and its row stride, summed (or NULL) and its row stride
    _i32,  # threads
]  # fmt: skip
_QK_NORM_ROPE_ARGTYPES = [
    _ptr, _i64, _i64, _i32, _i32,  # x, its token stride, tokens, heads, head_dim
    _ptr, _f32,  # weight [heads, head_dim] (or NULL), eps
    _ptr, _ptr, _i64, _i32,  # cos, sin, their token stride, rotated pairs per head
    _i32,  # threads
]  # fmt: skip
_SILU_AND_MUL_ARGTYPES = [_ptr, _i64, _i64, _i32, _ptr, _i64, _i32]
_SMALL_LINEAR_ARGTYPES = [
    _ptr, _i64, _i64,  # x, its row stride, rows
    _ptr, _i64, _i64, _ptr,  # weight [out, in], out, in, bias (or NULL)
    _ptr, _i64, _i32,  # y and its row stride, threads
]  # fmt: skip
# The most rows the compiled linear takes. At one and two rows it streams the weight ~1.2x as
# fast as oneDNN's packed copy, at three to eight as fast or faster (all rows against each weight
# vector at once; `bench`/Qwen3-0.6B shapes, and 2-3x at the default model's tiny ones, where
# oneDNN's call costs more than the product), and a row's bits never depend on the rows beside
# it. Must not exceed SMALL_LINEAR_MAX_ROWS in the source.
SMALL_LINEAR_MAX_ROWS = 8
# Off (0, false, no, off) keeps oneDNN's packed weight for one and two rows too.
SMALL_LINEAR_ENV = "CONVEYOR_SMALL_LINEAR"


class TokenOps:
    """The loaded library."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._add_rms_norm = {
            torch.float32: native.status_function(
                library, "conveyor_add_rms_norm", _ADD_RMS_NORM_ARGTYPES
            ),
            torch.bfloat16: native.status_function(
                library, "conveyor_add_rms_norm_bf16", _ADD_RMS_NORM_ARGTYPES
            ),
        }
        self._qk_norm_rope = {
            torch.float32: native.status_function(
                library, "conveyor_qk_norm_rope", _QK_NORM_ROPE_ARGTYPES
            ),
            torch.bfloat16: native.status_function(
                library, "conveyor_qk_norm_rope_bf16", _QK_NORM_ROPE_ARGTYPES
            ),
        }
        self._silu_and_mul = {
            torch.float32: native.status_function(
                library, "conveyor_silu_and_mul", _SILU_AND_MUL_ARGTYPES
            ),
            torch.bfloat16: native.status_function(
                library, "conveyor_silu_and_mul_bf16", _SILU_AND_MUL_ARGTYPES
            ),
        }
        self._small_linear = native.status_function(
            library, "conveyor_small_linear", _SMALL_LINEAR_ARGTYPES
        )
        # A build without OpenMP runs small_linear on one thread: worth it only where torch
        # runs one too.
        self.threaded = bool(library.conveyor_token_ops_threaded())

    @staticmethod
    def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """CPU float32 or bfloat16 rows with dense last dimensions and one weight per column, all
        of one dtype (bfloat16 rows a multiple of 8 wide)."""
        return (
            x.is_cpu
            and x.dtype in DTYPES
            and TokenOps.takes_rows(x, residual)
            and TokenOps.takes_weight(weight, x.shape[-1], x.dtype)
        )

    @staticmethod
    def takes_weight(weight: torch.Tensor, size: int, dtype: torch.dtype) -> bool:
        return (
            weight.is_cpu
            and weight.dtype == dtype
            and weight.shape == (size,)
            and weight.is_contiguous()
            and (dtype == torch.float32 or size % 8 == 0)
        )

    @staticmethod
    def takes_rows(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether ``x`` (on the CPU in one of ``DTYPES``, which the caller has checked) and
        ``residual`` fit."""
        return (
            x.dim() == 2
            and x.stride(1) == 1
            and (
                residual is None
                or (
                    residual.shape == x.shape
                    and residual.stride(1) == 1
                    and residual.dtype == x.dtype
                    and residual.is_cpu
                )
            )
        )

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(norm(x + residual) * weight, x + residual); without ``residual``, (norm(x) * weight,
        None). Fresh tensors: the inputs are left as they were. ``supports`` must hold."""
        num_rows, size = x.shape
        dtype = x.dtype
        out = torch.empty((num_rows, size), dtype=dtype)
        if residual is None:
            summed = None
            residual_ptr = summed_ptr = residual_stride = 0
        else:
            summed = torch.empty((num_rows, size), dtype=dtype)
            residual_ptr, residual_stride = residual.data_ptr(), residual.stride(0)
            summed_ptr = summed.data_ptr()
        status = self._add_rms_norm[dtype](
            x.data_ptr(), x.stride(0), residual_ptr, residual_stride,
            weight.data_ptr(), num_rows, size, eps,
            out.data_ptr(), size, summed_ptr, size,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"add_rms_norm failed with status {status}")
        return out, summed

    @staticmethod
    def takes_heads(
        x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> bool:
        """Whether ``qk_norm_rope_`` takes these: CPU float32 or bfloat16 heads [T, heads,
        head_dim], each head dense and the heads side by side; ``weight`` (or None) [heads,
        head_dim] dense; cos and sin [T, 1, half] (RotaryAngles) with dense rows, one stride; all
        of one dtype."""
        if not (x.is_cpu and x.dtype in DTYPES and x.dim() == 3 and x.shape[0] > 0):
            return False
        num_tokens, num_heads, head_dim = x.shape
        if x.stride(2) != 1 or (num_heads > 1 and x.stride(1) != head_dim):
            return False
        if weight is not None and not (
            weight.is_cpu
            and weight.dtype == x.dtype
            and weight.shape == (num_heads, head_dim)
            and weight.is_contiguous()
        ):
            return False
        return (
            all(
                a.is_cpu
                and a.dtype == x.dtype
                and a.dim() == 3
                and a.shape[0] == num_tokens
                and a.shape[1] == 1
                and 2 * a.shape[2] <= head_dim
                and a.stride(2) == 1
                for a in (cos, sin)
            )
            and cos.shape == sin.shape
            and cos.stride(0) == sin.stride(0)
        )

    def qk_norm_rope_(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """In place on ``x`` [T, heads, head_dim]: each head's RMSNorm times ``weight`` (skipped
        when None), then its neox rotation by cos, sin [T, 1, half]. ``takes_heads`` must hold."""
        num_tokens, num_heads, head_dim = x.shape
        status = self._qk_norm_rope[x.dtype](
            x.data_ptr(), x.stride(0), num_tokens, num_heads, head_dim,
            None if weight is None else weight.data_ptr(), eps,
            cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.shape[2],
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"qk_norm_rope failed with status {status}")
        return x

    @staticmethod
    def takes_gated(x: torch.Tensor) -> bool:
        """Whether ``silu_and_mul`` takes ``x``: CPU float32 or bfloat16 [T, 2 * size] with dense
        rows."""
        return (
            x.is_cpu
            and x.dtype in DTYPES
            and x.dim() == 2
            and x.shape[1] % 2 == 0
            and x.shape[1] > 0
            and x.stride(1) == 1
        )

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x = [gate | up] [T, 2 * size] -> silu(gate) * up, fresh [T, size]. ``takes_gated``
        must hold."""
        num_rows, size = x.shape[0], x.shape[1] // 2
        out = torch.empty((num_rows, size), dtype=x.dtype)
        status = self._silu_and_mul[x.dtype](
            x.data_ptr(), x.stride(0), num_rows, size, out.data_ptr(), size,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"silu_and_mul failed with status {status}")
        return out

    @staticmethod
    def takes_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether ``small_linear`` takes these: CPU float32 x [rows <= SMALL_LINEAR_MAX_ROWS,
        in > 0] with dense rows, weight [out, in] dense, bias [out] dense or None, and nothing
        that autograd must follow (the kernel's output has no history)."""
        if torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        ):
            return False
        return (
            x.is_cpu
            and x.dtype == torch.float32
            and x.dim() == 2
            and 0 < x.shape[0] <= SMALL_LINEAR_MAX_ROWS
            and x.shape[1] > 0
            and x.stride(1) == 1
            and weight.is_cpu
            and weight.dtype == torch.float32
            and weight.dim() == 2
            and weight.shape[1] == x.shape[1]
            and weight.is_contiguous()
            and (
                bias is None
                or (
                    bias.is_cpu
                    and bias.dtype == torch.float32
                    and bias.shape == (weight.shape[0],)
                    and bias.is_contiguous()
                )
            )
        )

    def small_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x W^T (+ bias), fresh [rows, out]. ``takes_linear`` must hold."""
        num_rows, out_features = x.shape[0], weight.shape[0]
        out = torch.empty((num_rows, out_features), dtype=x.dtype)
        status = self._small_linear(
            x.data_ptr(), x.stride(0), num_rows,
            weight.data_ptr(), out_features, weight.shape[1],
            None if bias is None else bias.data_ptr(),
            out.data_ptr(), out_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"small_linear failed with status {status}")
        return out


@functools.cache
def small_linear_enabled() -> bool:
    """Whether linears of one to eight rows take ``small_linear``: CONVEYOR_SMALL_LINEAR (a value
    that is neither on nor off is refused; the CPU model runner asks at start-up)."""
    from conveyor.worker.kv_cache import (
        switch_from_env,  # imported here: kv_cache imports the layers
    )

    return switch_from_env(SMALL_LINEAR_ENV)


@functools.cache
def load_token_ops() -> TokenOps | None:
    """The library, built if needed; None (logged once) where it is off or cannot be built."""
    # Without a compiler the worker's start-up warning has said so, and what it costs.
    return native.load_optional(
        logger, "compiled CPU token ops", "using torch ops", SOURCE_PATH, _inputs(),
        _from_library, no_compiler_level=logging.INFO,
    )  # fmt: skip


def _inputs() -> list[Path]:
    return [SOURCE_PATH, VECTOR_MATH_PATH]


def _from_library(library: ctypes.CDLL, path: Path) -> TokenOps:
    native.check_abi(library, path, "conveyor_token_ops_abi_version", ABI_VERSION)
    return TokenOps(library, path)
