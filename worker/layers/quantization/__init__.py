"""Quantized checkpoints: the formats conveyor reads, by config.json's ``quant_method``.

Runs in worker processes. Adding a format is one file implementing base.CheckpointFormat and one
line in ``FORMATS``; loading.py applies whichever the checkpoint names.
"""

from __future__ import annotations

from typing import Any

from conveyor.worker.layers.quantization.awq import AWQ
from conveyor.worker.layers.quantization.base import CheckpointFormat, UnsupportedQuantization
from conveyor.worker.layers.quantization.compressed_tensors import CompressedTensors
from conveyor.worker.layers.quantization.fp8 import FP8
from conveyor.worker.layers.quantization.gptq import GPTQ

FORMATS: dict[str, type[CheckpointFormat]] = {
    "compressed-tensors": CompressedTensors,
    "gptq": GPTQ,
    "awq": AWQ,
    "fp8": FP8,
}


def checkpoint_format(
    hf_config: dict[str, Any], requested: str | None = None
) -> CheckpointFormat | None:
    """The format config.json's quantization_config names (None: an unquantized checkpoint, or
    gpt-oss's mxfp4, which its model unpacks itself); ``requested``: ``--quantization``'s
    checkpoint format, which must be the checkpoint's."""
    qconfig = hf_config.get("quantization_config") or {}
    method = qconfig.get("quant_method")
    if requested is not None and requested in FORMATS and requested != method:
        raise UnsupportedQuantization(
            f"--quantization {requested}, but the checkpoint is "
            f"{f'{method}-quantized' if method else 'not quantized'}"
        )
    if method is None or method == "mxfp4":
        return None
    if requested is not None and requested not in FORMATS:
        raise UnsupportedQuantization(
            f"--quantization {requested} quantizes a float checkpoint at load; this one is "
            f"already {method}-quantized"
        )
    if method not in FORMATS:
        raise UnsupportedQuantization(
            f"{method}-quantized checkpoints are not loaded; conveyor reads "
            f"{', '.join(FORMATS)} and mxfp4"
        )
    return FORMATS[method](qconfig)


__all__ = ["FORMATS", "CheckpointFormat", "UnsupportedQuantization", "checkpoint_format"]
