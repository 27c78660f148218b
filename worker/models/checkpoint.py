"""How Hugging Face checkpoint tensors map onto our parameters, and the loop that copies them.

Runs in worker processes. A checkpoint holds q_proj, k_proj, v_proj, gate_proj and up_proj apart;
we fuse each group into one parameter (one matmul instead of three or two), so those tensors land
in a slice of a fused parameter, placed by the parameter's own ``weight_loader`` and shard id.
A checkpoint that already fuses them (Phi-3's qkv_proj, gate_up_proj) names our parameter itself;
its tensor arrives with no shard id and the loader splits it. Mixture-of-experts checkpoints hold
each expert's projections apart too; every expert of a layer lands in two stacked parameters.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from conveyor.worker.layers import default_weight_loader

# Checkpoint tensors that land in a slice of one of our fused parameters:
# (our parameter, the checkpoint's name for the part, shard id).
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
ShardId = str | int | tuple[int, str] | None
GATE_UP_SHARDS = {"gate": 0, "up": 1}


@dataclass(frozen=True)
class ExpertNaming:
    """What a mixture-of-experts checkpoint calls its sparse block and each expert's parts.

    The checkpoint holds every expert's gate, up and down projections apart,
    ``<block>.experts.<E>.<part>.weight``; we stack them into two parameters per layer,
    ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``, shard id (expert, part).
    """

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def part_of(self, name: str) -> str | None:
        return {self.gate: "gate", self.up: "up", self.down: "down"}.get(name)


QWEN_MOE_EXPERTS = ExpertNaming()
MIXTRAL_EXPERTS = ExpertNaming("block_sparse_moe", "w1", "w3", "w2")
# Our stacked expert parameter -> the parts it holds.
EXPERT_PARAMS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PARAM = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
# A quantized checkpoint's expert tensor once translated (``<expert>.<part>.quant.codes``): it
# lands in that expert's own quantized linears, not in the float stacks.
_QUANTIZED_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.quant\.")


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
    parts_seen: dict[str, set[ShardId]] = defaultdict(set)
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
        # A tensor with no shard id fills the whole parameter, fused parts and all (Phi-3).
        parts_seen[param_name] |= parts_of(param_name) if shard_id is None else {shard_id}
    return {name for name, seen in parts_seen.items() if seen >= parts_of(name, params[name])}


def checkpoint_names(
    param_name: str, experts: ExpertNaming | None = None, num_experts: int = 0
) -> list[str]:
    """The checkpoint tensors that make up one of our parameters (``experts``, ``num_experts``:
    how a mixture-of-experts family's checkpoint names its sparse blocks, and their size)."""
    if experts is not None:
        moe_names = _moe_checkpoint_names(param_name, experts, num_experts)
        if moe_names is not None:
            return moe_names
    fused = next((f for f, _, _ in STACKED_PARAMS if f".{f}." in param_name), None)
    if fused is None:
        return [param_name]
    return [
        param_name.replace(f".{fused}.", f".{part}.") for f, part, _ in STACKED_PARAMS if f == fused
    ]


def _moe_checkpoint_names(
    param_name: str, experts: ExpertNaming, num_experts: int
) -> list[str] | None:
    match = _EXPERT_PARAM.search(param_name)
    if match is not None:
        block = f"{param_name[: match.start()]}.{experts.block}.experts"
        parts = [getattr(experts, part) for part in EXPERT_PARAMS[match[1]]]
        return [f"{block}.{e}.{part}.weight" for e in range(num_experts) for part in parts]
    if param_name.endswith(".mlp.gate.weight"):  # the router
        return [param_name.replace(".mlp.gate.", f".{experts.block}.gate.")]
    return None


def param_name_of(name: str) -> tuple[str, ShardId]:
    """A checkpoint tensor's name -> (our parameter's name, the shard id of its part)."""
    # Mixtral's sparse block is "block_sparse_moe"; ours is "mlp" in every family.
    name = name.replace(f".{MIXTRAL_EXPERTS.block}.", ".mlp.")
    match = _QUANTIZED_EXPERT_TENSOR.search(name)
    if match is not None:
        for naming in (QWEN_MOE_EXPERTS, MIXTRAL_EXPERTS):
            part = naming.part_of(match[2])
            if part is not None:
                param = "down_proj" if part == "down" else "gate_up_proj"
                shard_id = None if part == "down" else GATE_UP_SHARDS[part]
                before, after = name[: match.start()], name[match.end() :]
                return f"{before}.experts.{match[1]}.{param}.quant.{after}", shard_id
    match = _EXPERT_TENSOR.search(name)
    if match is not None:
        for naming in (QWEN_MOE_EXPERTS, MIXTRAL_EXPERTS):
            part = naming.part_of(match[2])
            if part is not None:
                param = "gate_up_proj" if part in EXPERT_PARAMS["gate_up_proj"] else "down_proj"
                return f"{name[: match.start()]}.experts.{param}", (int(match[1]), part)
    for fused, part, shard_id in STACKED_PARAMS:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def parts_of(param_name: str, param: torch.Tensor | None = None) -> set[ShardId]:
    """The shard ids that together fill a parameter (every expert's parts for stacked experts)."""
    match = _EXPERT_PARAM.search(param_name)
    if match is not None and param is not None:
        return {(e, part) for e in range(param.shape[0]) for part in EXPERT_PARAMS[match[1]]}
    parts: set[ShardId] = {
        shard for fused, _, shard in STACKED_PARAMS if f".{fused}." in param_name
    }
    return parts or {None}
