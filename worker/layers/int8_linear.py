"""Weight-only int8 linears on CPU (``--quantization int8``).

Runs in worker processes. At load time each decoder linear's weight [out, in] becomes int8 with
one symmetric scale per output row (``scale = max |w| / 127``, ``q = round(w / scale)``), a
quarter of float32's bytes (half of bfloat16's); activations stay in the model's dtype and the
products are summed in float32 by ``csrc/int8_gemm.c``, built and cached like the attention
kernel (``worker.native``). A decode step of a few requests reads each weight once, so it is
bound by memory bandwidth, and reading a quarter of the bytes makes it up to ~4x faster on a
model larger than the CPU's caches; at larger batches the kernel runs at float32's speed.
Where the kernel cannot be built, or
``CONVEYOR_CPU_KERNEL=0``, each call widens the weight with torch ops instead: the same result,
slower than float32.

Quantized: the column- and row-parallel linears (attention q/k/v and output projections, MLP
gate/up/down), the mixture-of-experts experts' matrices and the LM head (a copy the logits
read), each tensor-parallel rank its own slice with its own scales. Left in the model's dtype:
embeddings (a tied one keeps the float table), norms, biases and the experts' routers.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import nn

from conveyor.worker import native

logger = logging.getLogger(__name__)

SOURCE_PATH = Path(__file__).parent / "csrc" / "int8_gemm.c"
# Must match CONVEYOR_INT8_GEMM_ABI_VERSION in the source.
ABI_VERSION = 3
QMAX = 127

_i32, _i64, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_LINEAR_ARGTYPES = [
    _ptr, _i64, _i64, _i64,  # x and its row stride, rows, in features
    _ptr, _ptr, _ptr, _i64,  # packed weight, scale, bias (or NULL), out features
    _ptr, _i64, _i32,  # out and its row stride, threads
]  # fmt: skip
_GROUPED_ARGTYPES = [
    _ptr, _i64, _i64, _i64,  # x and its row stride, rows, in features
    _ptr, _ptr, _ptr, _ptr, _i64, _i64,  # packed weight, scales, zeros (or NULL), bias, N, group
    _ptr, _i64, _i32,  # out and its row stride, threads
]  # fmt: skip
_W8A8_ARGTYPES = [
    _ptr, _i64, _i64, _i64,  # x and its row stride, rows, in features
    _ptr, _ptr, _ptr, _ptr, _i64,  # packed weight, column sums, scale, bias (or NULL), N
    _i32, _ptr, _i64, _i32,  # one activation scale for all rows, out and its row stride, threads
]  # fmt: skip
W8A8_QUAD = 4  # input features of a column in one 32-bit lane of the W8A8 panels


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q int8 [out, in], scale float32 [out]), w ~ q * scale per row.

    Symmetric, per output row: the largest magnitude maps to 127, so every element is within
    scale / 2 of its original. An all-zero row gets scale 0 and zeros.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / QMAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / divisor[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


class Int8Gemm:
    """The loaded library."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.panel_width = int(library.conveyor_int8_panel_width())
        self.vector_widening = bool(library.conveyor_int8_vector_widening())
        self._linear = native.status_function(library, "conveyor_int8_linear", _LINEAR_ARGTYPES)
        self._linear_grouped = native.status_function(
            library, "conveyor_int8_linear_grouped", _GROUPED_ARGTYPES
        )
        self._linear_w8a8 = native.status_function(
            library, "conveyor_int8_linear_w8a8", _W8A8_ARGTYPES
        )
        # Built with AVX-512 VNNI (the W8A8 path's integer dot products); else it is absent.
        self.w8a8 = bool(library.conveyor_int8_w8a8_available())

    def pack(self, q: torch.Tensor) -> torch.Tensor:
        """q [N, K] -> [ceil(N / panel)][K][panel], zero-padded: the layout the kernel reads."""
        n, k = q.shape
        width = self.panel_width
        padded = torch.zeros(_round_up(n, width), k, dtype=torch.int8)
        padded[:n] = q
        return padded.view(-1, width, k).transpose(1, 2).contiguous()

    def panel_groups(self, values: torch.Tensor) -> torch.Tensor:
        """[N, groups] float32 -> [panels][groups][panel], zero-padded columns."""
        width = self.panel_width
        padded = torch.zeros(_round_up(values.shape[0], width), values.shape[1])
        padded[: values.shape[0]] = values
        return padded.view(-1, width, values.shape[1]).transpose(1, 2).contiguous()

    def pad(self, values: torch.Tensor) -> torch.Tensor:
        """A per-output-row float32 vector padded with zeros to whole panels."""
        padded = torch.zeros(_round_up(values.shape[0], self.panel_width), dtype=torch.float32)
        padded[: values.shape[0]] = values
        return padded

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
    ) -> torch.Tensor:
        """x float32 [M, K] with dense rows -> float32 [M, out_features]."""
        num_rows, in_features = x.shape
        out = torch.empty((num_rows, out_features), dtype=torch.float32)
        status = self._linear(
            x.data_ptr(), x.stride(0), num_rows, in_features,
            packed.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(),
            out_features, out.data_ptr(), out_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"int8 linear failed with status {status}")
        return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.cache
def load_int8_gemm() -> Int8Gemm | None:
    """The library, built if needed; None (logged once) where it is off or cannot be built."""
    gemm = native.load_optional(
        logger, "int8 kernel", "int8 linears widen with torch", SOURCE_PATH,
        [SOURCE_PATH, native.SHARED_HEADERS / "panel_tiles.h"], _from_library,
    )  # fmt: skip
    if gemm is not None and not gemm.vector_widening:
        logger.warning(
            "int8 kernel built without AVX2 or AVX-512 (%s): it widens int8 one value at a "
            "time, slower than float32's matmuls; drop --quantization for speed",
            gemm.path.name,
        )
    return gemm


def _from_library(library: ctypes.CDLL, path: Path) -> Int8Gemm:
    native.check_abi(library, path, "conveyor_int8_gemm_abi_version", ABI_VERSION)
    return Int8Gemm(library, path)


class Int8Weight:
    """One linear's int8 weight and what its forward reads: the kernel's packed layout and
    padded float32 scale and bias, or, without the kernel, q [N, K] and the scale for torch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.device.type != "cpu":
            raise ValueError(f"int8 weights run on CPU only, this one is on {weight.device}")
        self._store(*quantize_int8(weight), bias)

    @classmethod
    def from_quantized(
        cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Int8Weight:
        """A checkpoint's own int8 weight: q [N, K] int8 and one float32 scale per output row
        (weight = q * scale), taken as they are."""
        if q.dtype != torch.int8 or q.device.type != "cpu" or scale.shape != (q.shape[0],):
            raise ValueError("from_quantized takes a CPU int8 [N, K] and an [N] scale")
        weight = cls.__new__(cls)
        weight._store(q, scale.to(torch.float32), bias)
        return weight

    @classmethod
    def from_grouped(
        cls,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        group_size: int,
    ) -> Int8Weight | None:
        """Group-wise 8-bit weights (GPTQ 8-bit, W8A16 with groups): q [N, K] int8 (the
        checkpoint's unsigned codes minus 128), scales [N, K / group_size] float32 and, with
        zero points, zeros in the same shape (the code meaning 0.0, minus 128): weight =
        (q - zero) * scale per group. None where the compiled kernel is not at hand."""
        gemm = load_int8_gemm()
        if (
            gemm is None
            or q.shape[1] % group_size
            or scales.shape
            != (
                q.shape[0],
                q.shape[1] // group_size,
            )
        ):
            return None
        weight = cls.__new__(cls)
        weight.out_features, weight.in_features = q.shape
        weight.gemm, weight.group_size = gemm, group_size
        weight.q = gemm.pack(q)
        weight.scale = gemm.panel_groups(scales.to(torch.float32))
        weight.zeros = None if zeros is None else gemm.panel_groups(zeros.to(torch.float32))
        weight.bias = None
        return weight

    def _store(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = q.shape
        self.group_size, self.zeros = 0, None
        self.gemm = load_int8_gemm()
        if self.gemm is not None:
            self.q = self.gemm.pack(q)
            self.scale = self.gemm.pad(scale)
            self.bias = None if bias is None else self.gemm.pad(bias.detach().float())
        else:
            self.q, self.scale = q, scale
            self.bias = None if bias is None else bias.detach().float()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, _, t in self.weight_tensors())

    def weight_tensors(self) -> list[tuple[object, str, torch.Tensor]]:
        """(owner, attribute, tensor) of what a step reads: for moving them to huge pages."""
        names = [n for n in ("q", "scale", "zeros", "bias") if getattr(self, n) is not None]
        return [(self, name, getattr(self, name)) for name in names]

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] this computes with, (q - zero) * scale per group or
        q * scale per row (for tests and checks)."""
        if self.gemm is None:
            return self.q.float() * self.scale[:, None]
        panels, k, width = self.q.shape
        q = self.q.transpose(1, 2).reshape(panels * width, k)[: self.out_features].float()
        if not self.group_size:
            return q * self.scale[: self.out_features, None]
        groups = torch.arange(k) // self.group_size

        def rows(values: torch.Tensor) -> torch.Tensor:  # [panels][groups][width] -> [N, K]
            flat = values.transpose(1, 2).reshape(panels * width, -1)[: self.out_features]
            return flat[:, groups]

        zeros = 0.0 if self.zeros is None else rows(self.zeros)
        return (q - zeros) * rows(self.scale)

    def linear(
        self, x: torch.Tensor, with_bias: bool = True, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [..., in] in the model's dtype -> [..., out] in the same dtype; ``with_bias``: plus
        the bias it was made with; ``add``: plus another [out] vector (an expert's bias), in
        float32 before the result is rounded to x's dtype, as the own bias is."""
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"input has {x.shape[-1]} features, the layer takes {self.in_features}"
            )
        leading = x.shape[:-1]
        rows = native.float32_rows(x, self.in_features)
        bias = self.bias if with_bias else None
        if self.group_size:
            out = torch.empty((rows.shape[0], self.out_features), dtype=torch.float32)
            status = self.gemm._linear_grouped(
                rows.data_ptr(), rows.stride(0), rows.shape[0], self.in_features,
                self.q.data_ptr(), self.scale.data_ptr(),
                None if self.zeros is None else self.zeros.data_ptr(),
                None if bias is None else bias.data_ptr(), self.out_features, self.group_size,
                out.data_ptr(), self.out_features, torch.get_num_threads(),
            )  # fmt: skip
            if status != 0:
                raise RuntimeError(f"int8 grouped linear failed with status {status}")
        elif self.gemm is not None:
            out = self.gemm.linear(rows, self.q, self.scale, bias, self.out_features)
        else:
            out = torch.mm(rows, self.q.t().to(torch.float32)) * self.scale
            if bias is not None:
                out += bias
        if add is not None:
            out += add.float()
        return out.to(x.dtype).view(*leading, self.out_features)


def quantize_model(model: nn.Module, method: str) -> None:
    """Replace the weights of every column- and row-parallel linear and every mixture-of-experts
    expert with their int8 form, in place."""
    from conveyor.worker.layers.fused_moe import MoEExperts
    from conveyor.worker.layers.linear import ColumnParallelLinear, RowParallelLinear

    if method != "int8":
        raise ValueError(f"int8_linear quantizes to int8, not {method!r}")
    kinds = (ColumnParallelLinear, RowParallelLinear, MoEExperts)
    layers = [m for m in model.modules() if isinstance(m, kinds)]
    before = after = 0
    for layer in layers:
        if isinstance(layer, MoEExperts):
            before += layer.gate_up_proj.nbytes + layer.down_proj.nbytes
            layer.quantize_int8()
            after += sum(w.nbytes for pair in layer.int8 or () for w in pair)
        else:
            before += layer.weight.nbytes
            layer.quantize_int8()
            after += layer.int8.nbytes if layer.int8 else 0
    head = getattr(model, "lm_head", None)
    if head is not None:
        # The LM head too, as --quantization int4 does (and llama.cpp's 8-bit files): at one
        # request it is the largest matrix a step reads (Qwen3-0.6B's tied 151,936 x 1,024: 622
        # MB in float32, more than all its decoder linears in int8). A tied embedding keeps the
        # float table for its lookups.
        head.quantized = Int8Weight(head.weight.detach(), None)
        head.packed_weight = None
        before += head.weight.nbytes
        after += head.quantized.nbytes
    gemm = load_int8_gemm()
    logger.info(
        "int8 weights for %d layers: %.1f MB -> %.1f MB (%s)",
        len(layers),
        before / 1e6,
        after / 1e6,
        f"kernel {gemm.path.name}" if gemm else "torch ops, no kernel",
    )


class W8A8Weight:
    """A checkpoint's int8 weight (one symmetric scale per output row) whose activations are
    quantized to int8 at every matmul, one dynamic scale per row of x (or one for all of x):
    compressed-tensors' W8A8. The kernel (``conveyor_int8_linear_w8a8``, AVX-512 VNNI) rounds x
    as ``activations.quantize_activations`` does and multiplies the codes as integers; the
    result is the torch path's ``fake_quantize(x) @ dequantized.T`` up to float rounding."""

    def __init__(self, gemm: Int8Gemm, q: torch.Tensor, scale: torch.Tensor, per_tensor: bool):
        """q [N, K] int8, scale [N] float32 (weight = q * scale)."""
        if q.dtype != torch.int8 or scale.shape != (q.shape[0],):
            raise ValueError("W8A8Weight takes an int8 [N, K] and an [N] scale")
        self.gemm, self.per_tensor = gemm, per_tensor
        self.out_features, self.in_features = q.shape
        width = gemm.panel_width
        n, k = q.shape
        padded = torch.zeros(_round_up(n, width), _round_up(k, W8A8_QUAD), dtype=torch.int8)
        padded[:n, :k] = q
        # [panels][K / 4][width][4]: a column's 4 consecutive features in one 32-bit lane.
        quads = padded.view(-1, width, padded.shape[1] // W8A8_QUAD, W8A8_QUAD)
        self.q = quads.transpose(1, 2).contiguous()
        self.column_sums = padded.sum(dim=1, dtype=torch.int32)
        self.scale = gemm.pad(scale.to(torch.float32))

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.column_sums.nbytes + self.scale.nbytes

    def weight_tensors(self) -> list[tuple[object, str, torch.Tensor]]:
        """(owner, attribute, tensor) of what a step reads: for moving them to huge pages."""
        return [(self, name, getattr(self, name)) for name in ("q", "column_sums", "scale")]

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in], q * scale (for tests and checks)."""
        panels, quads, width, _ = self.q.shape
        q = self.q.transpose(1, 2).reshape(panels * width, quads * W8A8_QUAD)
        q = q[: self.out_features, : self.in_features]
        return q.float() * self.scale[: self.out_features, None]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> [..., N] (+ bias) in x's dtype (float32 inside)."""
        leading = x.shape[:-1]
        rows = native.float32_rows(x, self.in_features)
        if bias is not None:
            bias = self.gemm.pad(bias.detach().to(torch.float32))
        out = torch.empty((rows.shape[0], self.out_features), dtype=torch.float32)
        status = self.gemm._linear_w8a8(
            rows.data_ptr(), rows.stride(0), rows.shape[0], self.in_features,
            self.q.data_ptr(), self.column_sums.data_ptr(), self.scale.data_ptr(),
            None if bias is None else bias.data_ptr(), self.out_features, int(self.per_tensor),
            out.data_ptr(), self.out_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"W8A8 linear failed with status {status}")
        return out.to(x.dtype).view(*leading, self.out_features)
