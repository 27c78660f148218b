"""The compiled FP8 linear (``csrc/fp8_gemm.c``) and its weights' layout.

Runs in worker processes. FP8 checkpoints whose activations are rounded to e4m3 with dynamic
scales (Qwen3-FP8's 128 x 128 blocks with 128-feature activation groups; compressed-tensors
FP8_DYNAMIC and FP8_BLOCK; per-tensor FP8 with dynamic activations) keep their weights as the
bfloat16 of their e4m3 codes (exact: every e4m3 value is a bfloat16 one), 2 bytes a weight, and
multiply the activations' codes by them with AVX512-BF16's VDPBF16PS (exact products, float32
sums), the scales applied once per block of input features; on a host with AMX, from 8 rows,
on AMX tiles (the panels are TDPBF16PS's B operand as stored). The kernel rounds the activations
itself, exactly as ``activations.quantize_activations`` rounds them for the torch path (tested
code for code), so both paths see the same codes. Where the host has no AVX512-BF16, the kernel cannot be built, ``CONVEYOR_CPU_KERNEL=0``
or ``CONVEYOR_CPU_FP8_KERNEL=0``, the torch path of weights.py runs instead: the weights
dequantized at every matmul and multiplied in float32 as transformers does, slower, and the one
to pick where outputs must follow transformers' own arithmetic (FP8's rounding of activations
turns any other order of sums into whole FP8 steps on some activations, which small models
amplify; tests/frontend/test_parity_quantized.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from conveyor.worker import native
from conveyor.worker.attention.cpu_kernel import amx_wanted
from conveyor.worker.kv_cache import switch_from_env
from conveyor.worker.layers.quantization.scheme import FLOAT8, LinearScheme

logger = logging.getLogger(__name__)

SOURCE_PATH = Path(__file__).parent.parent / "csrc" / "fp8_gemm.c"
ABI_VERSION = 3  # CONVEYOR_FP8_GEMM_ABI_VERSION in the source
# The activations' scale strategies, as the source numbers them.
STRATEGIES = {"token": 0, "tensor": 1, "group": 2}

_i32, _i64, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_LINEAR_ARGTYPES = [
    _ptr, _i64, _i32, _i64, _i64,  # x and its row stride, activation strategy, rows, K
    _ptr, _ptr, _ptr, _i64, _i64,  # packed weight, weight block scales, bias (or NULL), N, block
    _ptr, _i64, _i32,  # out and its row stride, threads
]  # fmt: skip
_QUANTIZE_ARGTYPES = [
    _ptr, _i64, _i64, _i64, _i32, _i64,  # x and its row stride, rows, K, strategy, block
    _ptr, _ptr,  # codes out [M][K], scales out [M][K / block]
]  # fmt: skip


class FP8Gemm:
    """The loaded library."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.panel_width = int(library.conveyor_fp8_panel_width())
        self._linear = native.status_function(library, "conveyor_fp8_linear", _LINEAR_ARGTYPES)
        self._quantize = native.status_function(
            library, "conveyor_fp8_quantize", _QUANTIZE_ARGTYPES
        )
        self._amx_enable = native.amx_switch(library, "conveyor_fp8_amx_enable")
        # An AMX build on a host whose Linux granted the tile state, unless CONVEYOR_CPU_AMX=0.
        self.amx = self.set_amx(amx_wanted())

    def set_amx(self, on: bool) -> bool:
        """Turn the AMX path (many rows) on or off for every user of this library."""
        self.amx = self._amx_enable(on)
        return self.amx

    def quantize(
        self, x: torch.Tensor, strategy: str, block: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] float32 -> (codes float32 [M, K], scales [M, K / block]) as the linear
        rounds its activations (for tests against quantize_activations)."""
        x = x.to(torch.float32).contiguous()
        codes = torch.empty_like(x)
        scales = torch.empty(x.shape[0], x.shape[1] // block, dtype=torch.float32)
        status = self._quantize(
            x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], STRATEGIES[strategy], block,
            codes.data_ptr(), scales.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"FP8 quantize failed with status {status}")
        return codes, scales


def _from_library(library: ctypes.CDLL, path: Path) -> FP8Gemm | None:
    native.check_abi(library, path, "conveyor_fp8_gemm_abi_version", ABI_VERSION)
    if not library.conveyor_fp8_available():
        logger.info("FP8 kernel built without AVX512-BF16: FP8 linears dequantize with torch")
        return None
    return FP8Gemm(library, path)


@functools.cache
def load_fp8_gemm() -> FP8Gemm | None:
    """The library, built if needed; None where it is off (CONVEYOR_CPU_FP8_KERNEL=0 too),
    cannot be built or the host has no AVX512-BF16 (each logged once)."""
    if not switch_from_env("CONVEYOR_CPU_FP8_KERNEL"):
        return None
    return native.load_optional(
        logger, "FP8 kernel", "FP8 linears dequantize with torch", SOURCE_PATH,
        [SOURCE_PATH, *(native.SHARED_HEADERS / h for h in ("amx_permission.h", "panel_tiles.h"))],
        _from_library,
    )  # fmt: skip


def kernel_block(scheme: LinearScheme, in_features: int) -> int:
    """The input features the kernel sums before scaling (the blocks both sides' scales share),
    or 0 where it does not take the scheme: weights e4m3 per row, per tensor or in blocks;
    activations e4m3 with dynamic scales per token, per tensor, or per the weights' block."""
    w, a = scheme.weights, scheme.activations
    if w.kind != FLOAT8 or w.act_order or a is None or a.kind != FLOAT8 or not a.dynamic:
        return 0
    if w.group_size in (0, in_features) and a.strategy in ("token", "tensor"):
        block = in_features
    elif a.strategy == "group" and a.group_size == w.group_size:
        block = w.group_size
    else:
        return 0
    return block if block % 2 == 0 and in_features % block == 0 else 0


class FP8Panels:
    """One linear's FP8 weight in the kernel's layout: the bfloat16 bits of its codes
    [panels][K / 2][PANEL] (two features of a column in a 32-bit word) and float32 scales
    [panels][K / block][PANEL]."""

    def __init__(
        self,
        gemm: FP8Gemm,
        codes: torch.Tensor,
        scales: torch.Tensor,
        block: int,
        strategy: str,
    ) -> None:
        """codes [N, K] float8_e4m3fn; scales [N, K / block] float32 (weight = code * scale);
        strategy: the activations' ("token", "tensor", or "group" of ``block`` features)."""
        self.gemm, self.block = gemm, block
        self.strategy = strategy
        self.out_features, self.in_features = codes.shape
        width = gemm.panel_width
        n_padded = -(-self.out_features // width) * width
        padded = torch.zeros(n_padded, self.in_features, dtype=torch.bfloat16)
        padded[: self.out_features] = codes.to(torch.bfloat16)  # exact
        pairs = padded.view(torch.int32).view(-1, width, self.in_features // 2)
        self.codes = pairs.transpose(1, 2).contiguous()  # [P][K / 2][width]
        padded_scales = torch.zeros(n_padded, scales.shape[1], dtype=torch.float32)
        padded_scales[: self.out_features] = scales
        self.scales = padded_scales.view(-1, width, scales.shape[1]).transpose(1, 2).contiguous()

    def weight_tensors(self) -> list[tuple[object, str, torch.Tensor]]:
        """(owner, attribute, tensor) of what a step reads: for moving them to huge pages."""
        return [(self, name, getattr(self, name)) for name in ("codes", "scales")]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K], code * scale per block (for checks)."""
        panels, pairs, width = self.codes.shape
        bits = self.codes.transpose(1, 2).reshape(panels * width, pairs).contiguous()
        codes = bits.view(torch.bfloat16)[: self.out_features].float()
        scales = self.scales.transpose(1, 2).reshape(panels * width, -1)[: self.out_features]
        return codes * scales.repeat_interleave(self.block, dim=1)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> [..., N] (+ bias) in x's dtype (float32 inside)."""
        leading = x.shape[:-1]
        rows = native.float32_rows(x, self.in_features)
        if bias is not None:
            bias = bias.detach().to(torch.float32).contiguous()
        out = torch.empty((rows.shape[0], self.out_features), dtype=torch.float32)
        status = self.gemm._linear(
            rows.data_ptr(), rows.stride(0), STRATEGIES[self.strategy], rows.shape[0],
            self.in_features, self.codes.data_ptr(), self.scales.data_ptr(),
            None if bias is None else bias.data_ptr(), self.out_features, self.block,
            out.data_ptr(), self.out_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"FP8 linear failed with status {status}")
        return out.to(x.dtype).view(*leading, self.out_features)
