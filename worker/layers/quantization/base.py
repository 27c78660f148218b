"""The interface every quantized checkpoint format implements, and the refusal they share.

Runs in worker processes. A format reads config.json's ``quantization_config`` once, says which
scheme each checkpoint module (``model.layers.0.self_attn.q_proj``) was quantized with, and
translates that module's tensors into the layout of scheme.py, named ``<module>.quant.<param>``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from conveyor.worker.layers.quantization.scheme import LinearScheme


class UnsupportedQuantization(ValueError):
    """A format, option or module conveyor does not run; the message names it."""


class CheckpointFormat:
    name = ""
    # Tensor names (the part after the module's) that only a quantized module has.
    markers: tuple[str, ...] = ()

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def scheme_for(self, module: str) -> LinearScheme:
        """The scheme a module with quantized tensors was quantized with."""
        raise NotImplementedError

    def translate(self, module: str, suffix: str, tensor: torch.Tensor):
        """One checkpoint tensor of a quantized module -> (our suffix, tensor) pairs; our
        suffixes are ``quant.codes``, ``quant.scales``, ``quant.zeros``, ``quant.g_idx`` and
        ``quant.input_scale``; none for a tensor that carries nothing we need."""
        raise NotImplementedError


def matches(module: str, target: str, class_name: str = "Linear") -> bool:
    """compressed-tensors' target syntax: a class name, ``re:<regex>`` or a module name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in (class_name, module) or module.endswith(f".{target}")


def check_bits(name: str, bits: int, allowed: tuple[int, ...] = (4, 8)) -> None:
    if bits not in allowed:
        raise UnsupportedQuantization(
            f"{name} with {bits}-bit weights: conveyor runs {' and '.join(map(str, allowed))}-bit"
        )
