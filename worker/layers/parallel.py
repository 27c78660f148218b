"""Tensor-parallel helpers: shard sizes and the two collectives the layers need.

Runs in worker processes. With one rank both collectives are the identity, so a single-GPU or CPU
run never touches torch.distributed; with more, the process group set up by the worker is used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} does not split evenly across {denominator} ranks")
    return numerator // denominator


def all_reduce(partial: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum a tensor over the tensor-parallel ranks."""
    if tp_size == 1:
        return partial
    dist.all_reduce(partial)
    return partial


def all_gather_last_dim(shard: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Concatenate every rank's shard along the last dimension, in rank order."""
    if tp_size == 1:
        return shard
    shards = [torch.empty_like(shard) for _ in range(tp_size)]
    dist.all_gather(shards, shard.contiguous())
    return torch.cat(shards, dim=-1)
