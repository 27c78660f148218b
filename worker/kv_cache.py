"""How many KV blocks fit, and the per-layer KV cache tensors themselves.

Runs in worker processes. The engine core owns block accounting; a worker only reports how many
blocks it can hold (the engine takes the minimum over workers) and then allocates them. On CPU the
budget is a byte count from the config; on CUDA it is a fraction of the device memory left after
the model runner's profiling pass (a forward of the largest batch, so activations are counted).
"""

from __future__ import annotations

import torch

from protocol.config import ConfigError
from worker.attention.backend import AttentionBackend

# Below this a server cannot hold even one short request plus the block it grows into; failing at
# start-up with the numbers beats a scheduler that can never admit anything.
MIN_NUM_BLOCKS = 2


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers: keys and values of ``block_size`` tokens."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def num_blocks_for_memory(memory_bytes: int, bytes_per_block: int) -> int:
    """Blocks that fit in ``memory_bytes``; an error if fewer than two do."""
    num_blocks = max(0, int(memory_bytes)) // bytes_per_block
    if num_blocks < MIN_NUM_BLOCKS:
        raise ConfigError(
            f"KV cache memory of {_format_bytes(memory_bytes)} holds {num_blocks} blocks, at least "
            f"{MIN_NUM_BLOCKS} are needed: one block needs {bytes_per_block} bytes "
            f"({_format_bytes(bytes_per_block)}) over all layers, so give the KV cache at least "
            f"{_format_bytes(MIN_NUM_BLOCKS * bytes_per_block)} (kv_cache_memory / gpu_memory_utilization) "
            f"or use a smaller block_size"
        )
    return num_blocks


def num_blocks_for_cuda(
    total_bytes: int, peak_bytes: int, gpu_memory_utilization: float, bytes_per_block: int
) -> int:
    """Blocks that fit in ``total * utilization - peak``, the peak measured while profiling."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    budget = int(total_bytes * gpu_memory_utilization) - int(peak_bytes)
    if budget < MIN_NUM_BLOCKS * bytes_per_block:
        raise ConfigError(
            f"no room for the KV cache: {gpu_memory_utilization:.0%} of {_format_bytes(total_bytes)} is "
            f"{_format_bytes(total_bytes * gpu_memory_utilization)}, the profiling pass peaked at "
            f"{_format_bytes(peak_bytes)}; {_format_bytes(MIN_NUM_BLOCKS * bytes_per_block)} more is needed for "
            f"{MIN_NUM_BLOCKS} blocks of {bytes_per_block} bytes"
        )
    return num_blocks_for_memory(budget, bytes_per_block)


def measure_cuda_memory(device: torch.device) -> tuple[int, int]:
    """(total, peak used) bytes on ``device`` after the profiling forward, for num_blocks_for_cuda.

    The peak is torch's own peak allocation plus whatever else holds device memory now (the CUDA
    context, communication buffers, other processes): memory in use that torch did not reserve.
    """
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    outside_torch = (total_bytes - free_bytes) - torch.cuda.memory_reserved(device)
    peak_bytes = torch.cuda.max_memory_allocated(device) + max(0, outside_torch)
    return total_bytes, peak_bytes


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
) -> list[torch.Tensor]:
    """One zeroed tensor per layer, shaped as the backend wants it."""
    if not backend.supports_block_size(block_size):
        raise ConfigError(
            f"attention backend {backend.name!r} does not support block_size {block_size}"
        )
    shape = backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def _format_bytes(num_bytes: float) -> str:
    if abs(num_bytes) >= 1 << 30:
        return f"{num_bytes / (1 << 30):.2f} GiB"
    return f"{num_bytes / (1 << 20):.2f} MiB"
