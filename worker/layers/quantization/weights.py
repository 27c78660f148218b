"""A quantized linear's weights as loaded from a quantized checkpoint, and its matmul.

Runs in worker processes. ``QuantizedWeights`` is a child module of the linear it replaces the
float weight of; its parameters (``codes``, ``scales``, ``zeros``, ``g_idx``, ``input_scale``;
scheme.py says what each holds) load through the linear's own tensor-parallel loaders, so a
fused q/k/v or gate/up layer fills each part's rows and a row-parallel one takes its columns.
The weights stay at the checkpoint's 4 or 8 bits. On CUDA each matmul is a Triton kernel (or
``torch._scaled_mm`` for FP8 x FP8) that reads them where they are (triton_quant.py); on a CPU,
group-wise 4-bit weights move into the compiled kernel's layout once loaded (int4_kernel.py) and
decode reads them there. Everything else, and wherever a kernel is unavailable, dequantizes with
torch ops and multiplies in float32: the reference path for every format.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from conveyor.worker.layers.int8_linear import Int8Weight, W8A8Weight, load_int8_gemm
from conveyor.worker.layers.quantization import triton_quant
from conveyor.worker.layers.quantization.activations import fake_quantize, quantize
from conveyor.worker.layers.quantization.fp8_kernel import FP8Panels, kernel_block, load_fp8_gemm
from conveyor.worker.layers.quantization.int4_kernel import (
    Int4Panels,
    kernel_takes_groups,
    kernel_takes_zeros,
    load_int4_gemm,
)
from conveyor.worker.layers.quantization.packing import unpack_nibbles
from conveyor.worker.layers.quantization.scheme import FLOAT8, INT, LinearScheme

# (param, loaded tensor, shard id) -> None: the linear's loader for one part of a parameter.
PartLoader = Callable[[nn.Parameter, torch.Tensor, object], None]


class QuantizedWeights(nn.Module):
    def __init__(
        self,
        scheme: LinearScheme,
        out_features: int,
        in_features: int,
        full_rows: Callable[[object], int],
        load_part: PartLoader,
    ) -> None:
        """``full_rows(shard_id)``: how many output rows the checkpoint tensor of that part has
        before tensor parallelism (a per-tensor or block scale is spread over them);
        ``load_part``: the linear's loader, which takes this rank's slice."""
        super().__init__()
        w = scheme.weights
        self.scheme = scheme
        self.out_features, self.in_features = out_features, in_features
        self._full_rows, self._load_part = full_rows, load_part
        # The compiled kernel's copy, once ``process_weights_after_loading`` made it: 4-bit
        # panels, or a channel-wise symmetric 8-bit weight in the int8 kernel.
        self.panels: Int4Panels | None = None
        self.int8: Int8Weight | None = None
        # W8A8 with dynamic int8 activations in the int8 kernel's integer path (AVX-512 VNNI).
        self.w8a8: W8A8Weight | None = None
        # FP8 with dynamic FP8 activations in the FP8 kernel (AVX512-BF16).
        self.fp8: FP8Panels | None = None
        # What the CUDA kernels do for each matmul, once ``process_weights_after_loading`` made it.
        self.kernel_plan: triton_quant.KernelPlan | None = None
        # Act-order weights whose input features the CUDA path sorted by group: feature j of
        # the codes (and g_idx) is the checkpoint's feature input_order[j]. None: in order.
        self.input_order: torch.Tensor | None = None
        if w.kind == INT and w.bits == 4:
            if in_features % 2:
                raise ValueError(f"4-bit weights need an even input size, got {in_features}")
            codes = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
        elif w.kind == INT:
            codes = torch.empty(out_features, in_features, dtype=torch.uint8)
        else:
            codes = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn)
        num_groups = 1 if w.group_size == 0 else -(-in_features // w.group_size)
        self.codes = self._param(codes)
        self.scales = self._param(torch.empty(out_features, num_groups, dtype=torch.float32))
        if not w.symmetric:
            self.zeros = self._param(torch.empty(out_features, num_groups, dtype=torch.float32))
        if w.act_order:
            self.g_idx = self._param(torch.empty(in_features, dtype=torch.int32), self._load_g_idx)
        a = scheme.activations
        if a is not None and not a.dynamic:
            self.input_scale = self._param(torch.empty(out_features, 1, dtype=torch.float32))

    def _param(self, tensor: torch.Tensor, loader: PartLoader | None = None) -> nn.Parameter:
        param = nn.Parameter(tensor, requires_grad=False)
        param.weight_loader = loader or self._load_rows  # type: ignore[attr-defined]
        return param

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        """Spread a per-tensor scale over the part's rows, and a block scale over its block's
        rows, before the linear's loader takes this rank's slice."""
        rows = self._full_rows(shard_id)
        block = self.scheme.weights.block_rows if param is self.scales else 0
        if loaded.shape[0] != rows and block and loaded.shape[0] == -(-rows // block):
            loaded = loaded.repeat_interleave(block, dim=0)[:rows]
        elif loaded.shape[0] == 1 and rows > 1:
            loaded = loaded.expand(rows, *loaded.shape[1:])
        elif loaded.shape[0] > rows:  # zero points packed eight rows to a word, padded
            loaded = loaded[:rows]
        self._load_part(param, loaded.to(param.dtype), shard_id)

    def _load_g_idx(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        # Every part of a fused layer reads the same input, so act-order gives them one order.
        loaded = loaded.to(torch.int32)
        if getattr(param, "loaded_once", False) and not torch.equal(param.data, loaded):
            raise ValueError("the fused parts' act-order g_idx differ; conveyor needs them equal")
        if loaded.shape != param.shape:
            raise ValueError(f"g_idx has {tuple(loaded.shape)}, the layer {tuple(param.shape)}")
        param.data.copy_(loaded)
        param.loaded_once = True  # type: ignore[attr-defined]

    def process_weights_after_loading(self) -> None:
        """Sort act-order weights' input features by group (triton_quant.py), then: on CUDA
        plan the Triton kernels' matmuls; on a CPU move group-wise 4-bit weights into the 4-bit
        kernel's layout, 8-bit ones into the int8 kernel's (W8A8 into its VNNI path), FP8 ones
        with dynamic activations into the FP8 kernel's, releasing the checkpoint layout (the
        kernel's copy is the only one; ``dequantized`` reads it). Once is enough: a second call
        (the loader's, after a caller's) leaves them as they are."""
        if any(k is not None for k in (self.panels, self.int8, self.w8a8, self.fp8)):
            return
        if self.codes.device.type == "cuda":
            if triton_quant.unavailable_reason() is None:
                triton_quant.sort_act_order_groups(self)
            self.kernel_plan = triton_quant.make_plan(self)
            return
        w = self.scheme.weights
        group_size = w.group_size or self.in_features
        if w.act_order:
            # Sorted by group (GPTQ's desc_act: every group a run of group_size features once
            # sorted), act-order weights are group-wise weights of a permuted input, which the
            # kernels take; linear() gathers x into that order.
            triton_quant.sort_act_order_groups(self)
        if self._int8_kernel_takes_it():
            q = (self.codes.data.to(torch.int16) - w.middle_code).to(torch.int8)
            if w.symmetric and group_size == self.in_features:
                self.int8 = Int8Weight.from_quantized(q, self.scales.data[:, 0])
            else:
                zeros = None if w.symmetric else self.zeros.data - w.middle_code
                self.int8 = Int8Weight.from_grouped(q, self.scales.data, zeros, group_size)
            if self.int8 is not None:
                for name in ("codes", "scales", "zeros"):
                    if name in self._parameters:
                        delattr(self, name)
                return
        block = kernel_block(self.scheme, self.in_features) if w.kind == FLOAT8 else 0
        gemm8 = load_fp8_gemm() if block and self.codes.device.type == "cpu" else None
        if gemm8 is not None:
            a = self.scheme.activations
            self.fp8 = FP8Panels(gemm8, self.codes.data, self.scales.data, block, a.strategy)
            for name in ("codes", "scales"):
                delattr(self, name)
            return
        if self._w8a8_kernel_takes_it():
            q = (self.codes.data.to(torch.int16) - w.middle_code).to(torch.int8)
            per_tensor = self.scheme.activations.strategy == "tensor"
            self.w8a8 = W8A8Weight(load_int8_gemm(), q, self.scales.data[:, 0], per_tensor)
            for name in ("codes", "scales"):
                delattr(self, name)
            return
        if (
            w.kind != INT
            or w.bits != 4
            or not self._groups_in_runs()
            or self.scheme.activations is not None
            or self.codes.device.type != "cpu"
            or not kernel_takes_groups(self.in_features, group_size)
        ):
            return
        gemm = load_int4_gemm()
        if gemm is None:
            return
        zeros = self.zeros.data if not w.symmetric else torch.full_like(self.scales, w.middle_code)
        if not kernel_takes_zeros(zeros):
            return
        codes = unpack_nibbles(self.codes)
        self.panels = Int4Panels(gemm, codes, self.scales.data, zeros, group_size)
        for name in ("codes", "scales", "zeros"):
            if name in self._parameters:
                delattr(self, name)

    def _groups_in_runs(self) -> bool:
        """Whether each group is a run of consecutive input features as stored: no act-order,
        or act-order sorted by group (``input_order``)."""
        return not self.scheme.weights.act_order or self.input_order is not None

    def _int8_kernel_takes_it(self) -> bool:
        """8-bit integer weights, weight-only, groups in runs (act-order sorted), on a CPU with the
        compiled int8 kernel: symmetric with one scale per output row (compressed-tensors W8A16
        as llm-compressor makes it: exactly what ``--quantization int8`` makes at load), else
        group-wise or with zero points (GPTQ 8-bit, W8A16 with groups), whose groups the kernel
        scales one by one."""
        w = self.scheme.weights
        return (
            w.kind == INT
            and w.bits == 8
            and self._groups_in_runs()
            and (w.group_size == 0 or self.in_features % w.group_size == 0)
            and self.scheme.activations is None
            and self.codes.device.type == "cpu"
            and load_int8_gemm() is not None
        )

    def _w8a8_kernel_takes_it(self) -> bool:
        """8-bit symmetric integers with one scale per output row and int8 activations with a
        dynamic scale per token or per tensor (compressed-tensors W8A8), on a CPU whose int8
        kernel was built with AVX-512 VNNI: the kernel rounds the activations as the torch path
        does and multiplies the codes as integers."""
        w, a = self.scheme.weights, self.scheme.activations
        gemm = load_int8_gemm() if self.codes.device.type == "cpu" else None
        return (
            gemm is not None
            and gemm.w8a8
            and w.kind == INT
            and w.bits == 8
            and w.symmetric
            and not w.act_order
            and w.group_size in (0, self.in_features)
            and a is not None
            and a.kind == INT
            and a.dynamic
            and a.strategy in ("token", "tensor")
        )

    def group_of_each_input(self) -> torch.Tensor:
        w = self.scheme.weights
        if w.act_order:
            return self.g_idx.long()
        if w.group_size == 0:
            return torch.zeros(self.in_features, dtype=torch.long)
        return torch.arange(self.in_features) // w.group_size  # a CPU index serves any device

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] the checkpoint means, ``(codes - zero) * scale``, its input
        features in the checkpoint's order."""
        weight = self._dequantized_as_stored(dtype)
        if self.input_order is None:
            return weight
        restored = torch.empty_like(weight)
        restored[:, self.input_order] = weight
        return restored

    def _dequantized_as_stored(self, dtype: torch.dtype) -> torch.Tensor:
        w = self.scheme.weights
        groups = self.group_of_each_input()
        if self.panels is not None:
            codes, scales, zeros = self.panels.unpacked()
            return ((codes.float() - zeros[:, groups]) * scales[:, groups]).to(dtype)
        if self.int8 is not None:
            return self.int8.dequantized().to(dtype)
        if self.w8a8 is not None:
            return self.w8a8.dequantized().to(dtype)
        if self.fp8 is not None:
            return self.fp8.dequantized().to(dtype)
        if w.kind == FLOAT8:
            return (self.codes.to(torch.float32) * self.scales[:, groups]).to(dtype)
        codes = unpack_nibbles(self.codes) if w.bits == 4 else self.codes
        zeros = self.zeros[:, groups] if not w.symmetric else float(w.middle_code)
        return ((codes.to(torch.float32) - zeros) * self.scales[:, groups]).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.panels is not None or self.int8 is not None:
            if self.input_order is not None:  # act-order sorted by group: x in that order too
                x = x.index_select(-1, self.input_order)
            if self.panels is not None:
                return self.panels.linear(x, bias)
            return self.int8.linear(x, with_bias=False, add=bias)
        if self.w8a8 is not None:
            return self.w8a8.linear(x, bias)
        if self.fp8 is not None:
            return self.fp8.linear(x, bias)
        if self.kernel_plan is not None and triton_quant.failure is None:
            out = triton_quant.linear(self, self.kernel_plan, x, bias)
            if out is not None:
                return out
        weight = self.dequantized(torch.float32)
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        a = self.scheme.activations
        if a is None:
            out = rows @ weight.T
        elif not a.dynamic:
            out = self._static_tensor_activations(rows, weight)
        else:
            out = fake_quantize(rows, a.kind, a.strategy, a.group_size) @ weight.T
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _static_tensor_activations(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The checkpoint's input scale per part (q, k and v each have their own): the input is
        quantized once per distinct scale and multiplies that part's rows."""
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32, device=rows.device)
        scales = self.input_scale[:, 0]
        for value in scales.unique().tolist():
            mask = scales == value
            scale = torch.tensor(value)
            quantized = quantize(rows, scale, self.scheme.activations.kind) * scale
            out[:, mask] = quantized @ weight[mask].T
        return out


__all__ = ["QuantizedWeights", "fake_quantize"]
