"""The compiled 4-bit weight-only linear (``csrc/int4_gemm.c``) and its weights' layout.

Runs in worker processes. Group-wise 4-bit weights whose groups are contiguous runs of input
features (every GPTQ without act-order, AWQ, compressed-tensors W4A16, ``--quantization int4``)
are repacked once after loading into the kernel's panels, and the checkpoint-layout copy is
released; decode then reads 4 bits per weight plus a scale and a zero per group. Where the
kernel cannot be built (or ``CONVEYOR_CPU_KERNEL=0``) the torch path of weights.py runs instead.

On a host with AMX (and Linux's grant of the tile state), seven rows or more multiply on AMX
tiles: the codes unpacked once per call to bfloat16 whole numbers, x split into three bfloat16
parts that hold its float32 value, so the products are exact and the sums float32's
(``CONVEYOR_CPU_AMX=0`` keeps the AVX-512 tile and the float32 GEMM).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from conveyor.worker import native
from conveyor.worker.attention.cpu_kernel import amx_wanted

logger = logging.getLogger(__name__)

SOURCE_PATH = Path(__file__).parent.parent / "csrc" / "int4_gemm.c"
ABI_VERSION = 5  # CONVEYOR_INT4_GEMM_ABI_VERSION in the source

_i32, _i64, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_LINEAR_ARGTYPES = [
    _ptr, _i64, _i64, _i64,  # x and its row stride, rows, in features
    _ptr, _ptr, _ptr, _ptr, _i64, _i64,  # code words, scales, 2^23 + zeros, bias, N, group
    _ptr, _i64, _i32,  # out and its row stride, threads
]  # fmt: skip
_DEQUANTIZE_ARGTYPES = [
    _ptr, _ptr, _ptr, _i64, _i64, _i64,  # code words, scales, 2^23 + zeros, N, K, group
    _ptr, _i32,  # out [K, N], threads
]  # fmt: skip
# From this many rows (a prefill chunk) the matmul writes W^T in float32 and multiplies with
# torch's GEMM: the kernel unpacks every code once per 6-row tile, one unpacking per call is a
# small share of a GEMM's work at hundreds of rows. Measured on one core of the 2-core Xeon
# (Qwen3-0.6B's gate_up and down, shared host): the tile took 0.37-0.63x the time of
# dequantize + GEMM at 32 rows, 0.45-0.56x at 64, 0.70-0.89x at 128, 1.15-1.17x at 256, 1.34-1.40x
# at 1,024.
GEMM_MIN_ROWS = 256
# From this many rows the AMX path runs where it can (it replaces both of the above). Up to 6
# rows the tile passes over the codes once and, prefetching them, reads them faster than the AMX
# path unpacks them: measured on the 2-core Xeon, 2 threads, Qwen3-0.6B's decoder linears from
# memory (`benchmarks quantized-decode --linears --rows ...`), AMX against the tile took
# 0.76-0.95x its speed at 2-6 rows, 1.02-1.27x at 7-8, 1.2-1.5x at 12, 2-2.3x at 64 and 256.
AMX_MIN_ROWS = 7
# The AMX path's tile products sum 32 input features; a group is a whole number of them.
AMX_GROUP_MULTIPLE = 32


class Int4Gemm:
    """The loaded library."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.panel_width = int(library.conveyor_int4_panel_width())
        self._linear = native.status_function(library, "conveyor_int4_linear", _LINEAR_ARGTYPES)
        self._dequantize_t = native.status_function(
            library, "conveyor_int4_dequantize_t", _DEQUANTIZE_ARGTYPES
        )
        self._linear_amx = native.status_function(
            library, "conveyor_int4_linear_amx", _LINEAR_ARGTYPES
        )
        self._amx_enable = native.amx_switch(library, "conveyor_int4_amx_enable")
        # An AMX build on a host whose Linux granted the tile state, unless CONVEYOR_CPU_AMX=0.
        self.amx = self.set_amx(amx_wanted())

    def set_amx(self, on: bool) -> bool:
        """Turn the AMX path on or off for every user of this library; whether it is on."""
        self.amx = self._amx_enable(on)
        return self.amx


def _from_library(library: ctypes.CDLL, path: Path) -> Int4Gemm:
    native.check_abi(library, path, "conveyor_int4_gemm_abi_version", ABI_VERSION)
    return Int4Gemm(library, path)


@functools.cache
def load_int4_gemm() -> Int4Gemm | None:
    """The library, built if needed; None (logged once) where it is off or cannot be built."""
    return native.load_optional(
        logger, "int4 kernel", "4-bit linears dequantize with torch", SOURCE_PATH,
        [SOURCE_PATH, *(native.SHARED_HEADERS / h for h in ("amx_permission.h", "panel_tiles.h"))],
        _from_library,
    )  # fmt: skip


CODES_PER_WORD = 8
# Where feature 8o + f of a word sits: 2i in bits 4i..4i+3, 2i + 1 in bits 4i+16..4i+19 (the
# AMX path reads a word shifted by 4i as the pair 2i, 2i + 1; csrc/int4_gemm.c's FEATURE_AT).
_SHIFTS = torch.tensor(
    [4 * (f // 2) + 16 * (f % 2) for f in range(CODES_PER_WORD)], dtype=torch.int32
)
# 2^23: a code in a float's low mantissa bits reads 2^23 + code; the kernel subtracts this + z.
MAGIC = float(1 << 23)


class Int4Panels:
    """One linear's 4-bit weights in the kernel's layout: code words [panels][K / 8][PANEL]
    int32 (a column's codes of 8 consecutive input features, in the order _SHIFTS says),
    scales [panels][groups][PANEL] float32 and 2^23 + the zero code in the same layout."""

    def __init__(
        self,
        gemm: Int4Gemm,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
    ) -> None:
        """codes [N, K] uint8 (0-15), scales and zeros [N, K / group_size] float32 (the zeros
        whole numbers 0-16, as every format's are: GPTQ's v1 format can say 16)."""
        if not kernel_takes_zeros(zeros):
            raise ValueError("the 4-bit kernel takes whole zero points 0-16")
        if not kernel_takes_groups(codes.shape[1], group_size):
            raise ValueError(f"the 4-bit kernel takes groups of a multiple of 8, not {group_size}")
        self.gemm = gemm
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        width = gemm.panel_width
        n_padded = -(-self.out_features // width) * width
        padded = torch.zeros(n_padded, self.in_features, dtype=torch.uint8)
        padded[: self.out_features] = codes
        octets = padded.view(-1, width, self.in_features // CODES_PER_WORD, CODES_PER_WORD)
        words = (octets.to(torch.int64) << _SHIFTS.to(torch.int64)).sum(-1)  # [P][width][K / 8]
        words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        self.codes = words.transpose(1, 2).contiguous()  # [P][K / 8][width]
        self.scales = _panel_groups(scales, n_padded, width)
        self.zero_offsets = _panel_groups(zeros + MAGIC, n_padded, width)

    def weight_tensors(self) -> list[tuple[object, str, torch.Tensor]]:
        """(owner, attribute, tensor) of what a step reads: for moving them to huge pages."""
        return [(self, name, getattr(self, name)) for name in ("codes", "scales", "zero_offsets")]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.zero_offsets.nbytes

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [N, K], scales, zeros [N, groups]) back from the panels (for checks)."""
        codes = (self.codes.unsqueeze(-1) >> _SHIFTS) & 0x0F  # [P][K / 8][width][8]
        codes = codes.permute(0, 2, 1, 3).reshape(-1, self.in_features)[: self.out_features]
        scales = self.scales.transpose(1, 2).reshape(-1, self.scales.shape[1])[: self.out_features]
        zeros = self.zero_offsets.transpose(1, 2).reshape(-1, self.scales.shape[1]) - MAGIC
        return codes.to(torch.uint8), scales, zeros[: self.out_features]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] (+ bias) in x's dtype (float32 inside)."""
        leading = x.shape[:-1]
        rows = native.float32_rows(x, self.in_features)
        if bias is not None:
            bias = bias.detach().to(torch.float32).contiguous()
        amx = (
            self.gemm.amx
            and rows.shape[0] >= AMX_MIN_ROWS
            and self.group_size % AMX_GROUP_MULTIPLE == 0
        )
        if rows.shape[0] >= GEMM_MIN_ROWS and not amx:
            out = rows @ self.dequantized_t()
            out = out if bias is None else out.add_(bias)
            return out.to(x.dtype).view(*leading, self.out_features)
        out = torch.empty((rows.shape[0], self.out_features), dtype=torch.float32)
        linear = self.gemm._linear_amx if amx else self.gemm._linear
        status = linear(
            rows.data_ptr(), rows.stride(0), rows.shape[0], self.in_features,
            self.codes.data_ptr(), self.scales.data_ptr(), self.zero_offsets.data_ptr(),
            None if bias is None else bias.data_ptr(), self.out_features, self.group_size,
            out.data_ptr(), self.out_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"int4 linear failed with status {status}")
        return out.to(x.dtype).view(*leading, self.out_features)

    def dequantized_t(self) -> torch.Tensor:
        """W^T [K, N] float32, made by the kernel from the panels (for many rows at once)."""
        out = torch.empty((self.in_features, self.out_features), dtype=torch.float32)
        status = self.gemm._dequantize_t(
            self.codes.data_ptr(), self.scales.data_ptr(), self.zero_offsets.data_ptr(),
            self.out_features, self.in_features, self.group_size, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"int4 dequantize failed with status {status}")
        return out


def kernel_takes_groups(in_features: int, group_size: int) -> bool:
    return group_size % CODES_PER_WORD == 0 and in_features % group_size == 0


def kernel_takes_zeros(zeros: torch.Tensor) -> bool:
    return bool(((zeros == zeros.round()) & (zeros >= 0) & (zeros <= 16)).all())


def _panel_groups(values: torch.Tensor, n_padded: int, width: int) -> torch.Tensor:
    """[N, groups] -> [panels][groups][width], zero-padded columns."""
    padded = torch.zeros(n_padded, values.shape[1], dtype=torch.float32)
    padded[: values.shape[0]] = values
    return padded.view(-1, width, values.shape[1]).transpose(1, 2).contiguous()


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """weight [N, K] -> (codes [N, K] uint8, scales [N, K / group], zeros [N, K / group]):
    symmetric per group, zero 8, the largest magnitude of a group at code 1 or 15, so every
    weight is within scale / 2 of its original (``--quantization int4``)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"{k} input features are not whole groups of {group_size}")
    grouped = weight.detach().float().reshape(n, k // group_size, group_size)
    scales = grouped.abs().amax(dim=-1) / 7
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(grouped / divisor[..., None]).clamp_(-7, 7) + 8
    zeros = torch.full_like(scales, 8.0)
    return codes.to(torch.uint8).reshape(n, k), scales, zeros
