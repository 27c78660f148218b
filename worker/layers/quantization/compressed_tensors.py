"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, llm-compressor's output).

Runs in worker processes. ``config_groups`` give each group of modules (by class name or
``re:`` pattern) a scheme and a storage format:

- ``pack-quantized``: integer weights of 4 or 8 bits, ``weight_packed`` int32 [out, in * bits /
  32] (lowest bits first, each value stored plus 2^(bits-1)), ``weight_scale`` [out, groups],
  and for asymmetric schemes ``weight_zero_point`` packed the same way along the output rows;
- ``int-quantized`` / ``naive-quantized``: int8 ``weight`` with its scales;
- ``float-quantized``: float8_e4m3fn ``weight`` with a scale per tensor, per output channel or
  per block.

Group-wise act-order adds ``weight_g_idx``. ``input_activations`` (int8 or FP8, dynamic per
token, per tensor or per group, or static with ``input_scale``) quantize each linear's input as
compressed-tensors itself runs the model. Sparse (2:4), transformed, KV-cache-quantized and
other bit widths are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from conveyor.worker.layers.quantization.base import (
    CheckpointFormat,
    UnsupportedQuantization,
    check_bits,
    matches,
)
from conveyor.worker.layers.quantization.packing import pack_nibbles, unpack_int32
from conveyor.worker.layers.quantization.scheme import (
    FLOAT8,
    INT,
    ActivationScheme,
    LinearScheme,
    WeightScheme,
)

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


class CompressedTensors(CheckpointFormat):
    name = "compressed-tensors"
    markers = ("weight_packed", "weight_scale")

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        for key, what in (
            ("sparsity_config", "sparsity (e.g. 2:4)"),
            ("transform_config", "transforms"),
            ("kv_cache_scheme", "KV cache quantization"),
        ):
            if config.get(key):
                raise UnsupportedQuantization(f"compressed-tensors with {what} ({key})")
        self.ignore = list(config.get("ignore") or [])
        default_format = config.get("format")
        self.groups: list[tuple[list[str], LinearScheme, str]] = []
        for name, group in (config.get("config_groups") or {}).items():
            fmt = group.get("format") or default_format
            if fmt not in FORMATS:
                raise UnsupportedQuantization(
                    f"compressed-tensors format {fmt!r} ({name}); conveyor reads "
                    f"{', '.join(FORMATS)}"
                )
            if group.get("output_activations"):
                raise UnsupportedQuantization(f"compressed-tensors output_activations ({name})")
            scheme = LinearScheme(
                _weight_scheme(name, group.get("weights") or {}),
                _activation_scheme(name, group.get("input_activations")),
            )
            if fmt == "pack-quantized" and scheme.weights.kind != INT:
                raise UnsupportedQuantization(f"pack-quantized float weights ({name})")
            self.groups.append((list(group.get("targets") or []), scheme, fmt))

    def scheme_for(self, module: str) -> LinearScheme:
        return self._group_of(module)[0]

    def _group_of(self, module: str) -> tuple[LinearScheme, str]:
        for targets, scheme, fmt in self.groups:
            if any(matches(module, t) for t in targets):
                return scheme, fmt
        raise UnsupportedQuantization(f"{module} has quantized tensors but no config group")

    def translate(self, module: str, suffix: str, tensor: torch.Tensor):
        scheme, fmt = self._group_of(module)
        w = scheme.weights
        if suffix == "weight_packed":
            codes = unpack_int32(tensor, w.bits, dim=1)
            yield "quant.codes", pack_nibbles(codes) if w.bits == 4 else codes
        elif suffix == "weight" and w.kind == INT:
            # int8 stored signed: the unsigned code is the value plus the middle code.
            yield "quant.codes", (tensor.to(torch.int16) + w.middle_code).to(torch.uint8)
        elif suffix == "weight":
            if tensor.dtype != torch.float8_e4m3fn:
                raise UnsupportedQuantization(f"{module}.weight is {tensor.dtype}, not fp8 e4m3")
            yield "quant.codes", tensor
        elif suffix == "weight_scale":
            scale = tensor.float()
            yield "quant.scales", scale.reshape(1, 1) if scale.numel() == 1 else scale
        elif suffix == "weight_zero_point" and not w.symmetric:
            if fmt == "pack-quantized":
                zeros = unpack_int32(tensor, w.bits, dim=0).float()
            else:
                zeros = tensor.float() + w.middle_code
            yield "quant.zeros", zeros.reshape(1, 1) if zeros.numel() == 1 else zeros
        elif suffix == "weight_g_idx" and w.act_order:
            yield "quant.g_idx", tensor.to(torch.int32)
        elif suffix == "input_scale" and scheme.activations and not scheme.activations.dynamic:
            yield "quant.input_scale", tensor.float().reshape(1, 1)
        elif suffix not in ("weight_shape", "weight_zero_point", "weight_g_idx", "input_scale"):
            yield suffix, tensor  # the bias


def _weight_scheme(group: str, args: dict[str, Any]) -> WeightScheme:
    kind = {"int": INT, "float": FLOAT8}.get(args.get("type", "int"))
    bits = int(args.get("num_bits", 8))
    if kind is None or (kind == FLOAT8 and bits != 8):
        raise UnsupportedQuantization(
            f"compressed-tensors {args.get('type')} weights of {bits} bits ({group})"
        )
    check_bits(f"compressed-tensors ({group})", bits)
    strategy = args.get("strategy", "tensor")
    actorder = args.get("actorder")
    group_size, block_rows = 0, 0
    if strategy == "group":
        group_size = int(args["group_size"])
    elif strategy == "block":
        block_rows, group_size = (int(b) for b in args["block_structure"])
    elif strategy not in ("channel", "tensor"):
        raise UnsupportedQuantization(f"compressed-tensors weight strategy {strategy!r} ({group})")
    if args.get("dynamic"):
        raise UnsupportedQuantization(f"compressed-tensors dynamic weight scales ({group})")
    return WeightScheme(
        kind,
        bits,
        group_size=group_size,
        symmetric=bool(args.get("symmetric", True)),
        act_order=actorder == "group",
        block_rows=block_rows,
    )


def _activation_scheme(group: str, args: dict[str, Any] | None) -> ActivationScheme | None:
    if not args:
        return None
    kind = {"int": INT, "float": FLOAT8}.get(args.get("type", "int"))
    if kind is None or int(args.get("num_bits", 8)) != 8 or not args.get("symmetric", True):
        raise UnsupportedQuantization(
            f"compressed-tensors input activations {args.get('type')}{args.get('num_bits')} "
            f"{'symmetric' if args.get('symmetric', True) else 'asymmetric'} ({group}); "
            "conveyor runs symmetric int8 and fp8"
        )
    strategy = args.get("strategy", "tensor")
    dynamic = bool(args.get("dynamic", False))
    if strategy not in ("token", "tensor", "group") or (not dynamic and strategy != "tensor"):
        raise UnsupportedQuantization(
            f"compressed-tensors {'dynamic' if dynamic else 'static'} activation strategy "
            f"{strategy!r} ({group})"
        )
    return ActivationScheme(kind, strategy, dynamic, int(args.get("group_size") or 0))
