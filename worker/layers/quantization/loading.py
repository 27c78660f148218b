"""Apply a quantized checkpoint's format to a built model before its weights load.

Runs in worker processes. Which checkpoint modules are quantized is read from the tensors' names
(a module is quantized when it has one of the format's marker tensors), so a format's ignore
list and per-module choices need no second reading. Each of our column- and row-parallel linears
whose checkpoint modules (q/k/v, gate/up fused) are quantized gets a ``QuantizedWeights`` child
in place of its float weight, and every mixture-of-experts block whose experts are quantized
loads them as quantized linears per expert (experts.py); every quantized module must land in
one, so a quantized LM head or router is refused by name instead of loading wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from conveyor.worker.layers.quantization.base import CheckpointFormat, UnsupportedQuantization
from conveyor.worker.layers.quantization.weights import QuantizedWeights


def quantized_modules(fmt: CheckpointFormat, tensor_names: Iterable[str]) -> set[str]:
    """The checkpoint modules the format quantized, from the names of the tensors."""
    modules = set()
    for name in tensor_names:
        module, _, suffix = name.rpartition(".")
        if suffix in fmt.markers:
            modules.add(module)
    return modules


def prepare_model(model: nn.Module, fmt: CheckpointFormat, quantized: set[str]) -> int:
    """Give every linear whose checkpoint modules are quantized its quantized weights; the
    number of linears changed."""
    from conveyor.worker.layers.fused_moe import MoEExperts
    from conveyor.worker.layers.linear import ColumnParallelLinear, RowParallelLinear

    if not quantized:
        raise UnsupportedQuantization(
            f"config.json says {fmt.name}, but no tensor is quantized ({', '.join(fmt.markers)})"
        )
    covered: set[str] = set()
    count = 0
    # A snapshot: the experts' quantized linears made below are not visited again.
    for name, layer in list(model.named_modules()):
        if isinstance(layer, MoEExperts):
            params = (f"{name}.gate_up_proj", f"{name}.down_proj")
        elif isinstance(layer, ColumnParallelLinear | RowParallelLinear):
            params = (f"{name}.weight",)
        else:
            continue
        parts = [n.removesuffix(".weight") for p in params for n in model.checkpoint_names(p)]
        hits = [p for p in parts if p in quantized]
        if not hits:
            continue
        if len(hits) != len(parts):
            missing = sorted(set(parts) - set(hits))
            raise UnsupportedQuantization(
                f"{name}: {', '.join(missing)} not quantized, the rest is"
            )
        schemes = {fmt.scheme_for(p) for p in parts}
        if len(schemes) != 1:
            raise UnsupportedQuantization(f"{name}: its parts {parts} have different schemes")
        layer.use_quantized_weights(schemes.pop())
        covered.update(parts)
        count += 1
    left = sorted(quantized - covered)
    if left:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        what = "mixture-of-experts experts" if any(".experts." in m for m in left) else "modules"
        raise UnsupportedQuantization(
            f"{fmt.name}: quantized {what} conveyor does not run quantized: {shown}"
        )
    return count


def translate_tensors(
    fmt: CheckpointFormat, quantized: set[str], weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized module's put into our layout."""
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if module not in quantized:
            yield name, tensor
            continue
        for our_suffix, ours in fmt.translate(module, suffix, tensor):
            yield f"{module}.{our_suffix}", ours


def quantized_nbytes(model: nn.Module) -> int:
    return sum(
        p.nbytes for m in model.modules() if isinstance(m, QuantizedWeights) for p in m.parameters()
    )
