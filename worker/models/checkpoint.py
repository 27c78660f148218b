"""How Hugging Face checkpoint tensors map onto our parameters, and the loop that copies them.

Runs in worker processes. A checkpoint holds q_proj, k_proj, v_proj, gate_proj and up_proj apart;
we fuse each group into one parameter (one matmul instead of three or two), so those tensors land
in a slice of a fused parameter, placed by the parameter's own ``weight_loader`` and shard id.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch import nn

from worker.layers import default_weight_loader

# Checkpoint tensors that land in a slice of one of our fused parameters:
# (our parameter, the checkpoint's name for the part, shard id).
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    is_unused: Callable[[str], bool],
) -> set[str]:
    """Copy checkpoint tensors (Hugging Face names) into ``model``'s parameters.

    Returns the names of the parameters that are now fully loaded: a fused parameter counts
    only once every one of its parts has arrived.
    """
    params = dict(model.named_parameters())
    parts_seen: dict[str, set[str | int | None]] = defaultdict(set)
    for name, tensor in weights:
        if is_unused(name):
            continue
        param_name, shard_id = param_name_of(name)
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param = params[param_name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from error
        parts_seen[param_name].add(shard_id)
    return {name for name, seen in parts_seen.items() if seen >= parts_of(name)}


def checkpoint_names(param_name: str) -> list[str]:
    """The checkpoint tensors that make up one of our parameters."""
    fused = next((f for f, _, _ in STACKED_PARAMS if f".{f}." in param_name), None)
    if fused is None:
        return [param_name]
    return [
        param_name.replace(f".{fused}.", f".{part}.") for f, part, _ in STACKED_PARAMS if f == fused
    ]


def param_name_of(name: str) -> tuple[str, str | int | None]:
    """A checkpoint tensor's name -> (our parameter's name, the shard id of its part)."""
    for fused, part, shard_id in STACKED_PARAMS:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def parts_of(param_name: str) -> set[str | int | None]:
    parts = {shard for fused, _, shard in STACKED_PARAMS if f".{fused}." in param_name}
    return parts or {None}
