"""How many KV blocks fit, and the per-layer KV cache tensors themselves.

Runs in worker processes. The engine core owns block accounting; a worker only reports how many
blocks it can hold (the engine takes the minimum over workers) and then allocates them. On CPU the
budget is a byte count from the config (1 GiB unless set); on CUDA it is what this engine's share
of the device leaves after the model runner's profiling pass (a forward of the largest batch, so
activations are counted), or the configured byte count where one is set, checked to fit there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from conveyor.protocol.config import ConfigError
from conveyor.worker.attention.backend import AttentionBackend
from conveyor.worker.host_memory import zeros_on_huge_pages

# Below this a server cannot hold even one short request plus the block it grows into; failing at
# start-up with the numbers beats a scheduler that can never admit anything.
MIN_NUM_BLOCKS = 2
# A CPU worker's KV cache when kv_cache_memory is unset (CUDA sizes it from the device instead).
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
# A CUDA engine's share of its device when gpu_memory_utilization is unset (vLLM's default).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def gpu_memory_utilization(configured: float | None, device: torch.device) -> float | None:
    """The share of the device this engine plans with: the configured one or the default on
    CUDA; None on CPU, where a configured share is refused (it would be silently ignored: the
    CPU cache's size is kv_cache_memory)."""
    if device.type == "cuda":
        return DEFAULT_GPU_MEMORY_UTILIZATION if configured is None else configured
    if configured is not None:
        raise ConfigError(
            f"gpu_memory_utilization {configured:g} applies to CUDA devices, this engine runs on "
            f"{device.type}: size the KV cache with kv_cache_memory (--kv-cache-memory) instead"
        )
    return None


# CONVEYOR_KV_HUGE_PAGES=0 keeps the CPU cache on ordinary pages (worker.host_memory), and
# CONVEYOR_WEIGHT_HUGE_PAGES=0 the CPU weights.
HUGE_PAGES_ENV = "CONVEYOR_KV_HUGE_PAGES"
WEIGHT_HUGE_PAGES_ENV = "CONVEYOR_WEIGHT_HUGE_PAGES"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch_from_env(name: str) -> bool:
    """An on/off environment switch, on unless set off (the spellings CONVEYOR_CPU_KERNEL
    takes); any other value is refused, not read as on."""
    value = os.environ.get(name, "1").strip().lower()
    if value not in _ON + _OFF:
        raise ConfigError(f"{name}={os.environ[name]!r}: use one of {', '.join(_ON + _OFF)}")
    return value in _ON


def weight_huge_pages_enabled() -> bool:
    """Whether CPU weights move to huge pages after loading: CONVEYOR_WEIGHT_HUGE_PAGES."""
    return switch_from_env(WEIGHT_HUGE_PAGES_ENV)


def huge_pages_enabled() -> bool:
    """Whether the CPU KV cache asks for huge pages: CONVEYOR_KV_HUGE_PAGES."""
    return switch_from_env(HUGE_PAGES_ENV)


def resolve_kv_cache_dtype(
    cache_dtype: str, model_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's torch dtype for ``--kv-cache-dtype``: "auto" is the model's. A cache of
    another dtype than the model's runs on CPU only (the GPU backends read their own dtype)."""
    if cache_dtype == "auto":
        return model_dtype
    dtype = {"bfloat16": torch.bfloat16}.get(cache_dtype)
    if dtype is None:
        raise ConfigError(f"kv_cache_dtype {cache_dtype!r} is not supported")
    if dtype != model_dtype and device.type != "cpu":
        raise ConfigError(
            f"kv_cache_dtype {cache_dtype!r} with a {model_dtype} model runs on CPU only, "
            f"this is {device.type}"
        )
    return dtype


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers: keys and values of ``block_size`` tokens."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def layers_bytes_per_block(layers: list, block_size: int, dtype: torch.dtype) -> int:
    """``kv_bytes_per_block`` of a model's attention layers (they share one head shape)."""
    first = layers[0]
    return kv_bytes_per_block(len(layers), block_size, first.num_kv_heads, first.head_dim, dtype)


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
    total_bytes: int,
    peak_bytes: int,
    gpu_memory_utilization: float,
    bytes_per_block: int,
    kv_cache_memory: int | None = None,
) -> int:
    """Blocks that fit in ``total * utilization - peak``, the peak being this engine's own
    (weights, the profiling pass, graphs; engine_peak_bytes). With ``kv_cache_memory`` (bytes)
    the cache is that size instead, refused with the numbers when the share cannot hold it: a
    fixed cache makes runs on different cards, or next to other engines, hold the same blocks."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    budget = int(total_bytes * gpu_memory_utilization) - int(peak_bytes)
    if budget < MIN_NUM_BLOCKS * bytes_per_block:
        raise ConfigError(
            f"no room for the KV cache: {gpu_memory_utilization:.0%} of {_format_bytes(total_bytes)} is "
            f"{_format_bytes(total_bytes * gpu_memory_utilization)}, the weights and profiling pass peaked at "
            f"{_format_bytes(peak_bytes)}; {_format_bytes(MIN_NUM_BLOCKS * bytes_per_block)} more is needed for "
            f"{MIN_NUM_BLOCKS} blocks of {bytes_per_block} bytes"
        )
    if kv_cache_memory is None:
        return num_blocks_for_memory(budget, bytes_per_block)
    num_blocks = num_blocks_for_memory(kv_cache_memory, bytes_per_block)
    if num_blocks * bytes_per_block > budget:
        raise ConfigError(
            f"kv_cache_memory {_format_bytes(kv_cache_memory)} does not fit: "
            f"{gpu_memory_utilization:.0%} of {_format_bytes(total_bytes)} is "
            f"{_format_bytes(total_bytes * gpu_memory_utilization)}, the weights and profiling pass peaked at "
            f"{_format_bytes(peak_bytes)}, which leaves {_format_bytes(budget)}; lower kv_cache_memory or "
            f"raise gpu_memory_utilization"
        )
    return num_blocks


@dataclass(frozen=True)
class CudaMemory:
    """A reading of one device's memory: the driver's view and torch's, in bytes."""

    total: int
    free: int
    allocated: int  # torch tensors of this process
    reserved: int  # torch's caching allocator, allocated or not

    @property
    def outside_torch(self) -> int:
        """In use but not by this process's torch: the CUDA context, NCCL, other processes."""
        return max(0, self.total - self.free - self.reserved)

    @staticmethod
    def read(device: torch.device) -> CudaMemory:
        free, total = torch.cuda.mem_get_info(device)
        return CudaMemory(
            total=total,
            free=free,
            allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
        )


def claim_cuda_memory(device: torch.device, gpu_memory_utilization: float) -> CudaMemory:
    """The reading a runner's accounting starts from, taken before it loads anything; an error
    naming the numbers when ``utilization`` of the device is not free now.

    Every engine on a device claims its own share (vLLM's meaning): what others hold (an earlier
    in-process engine, another server) is not counted against this one, but the share must be
    free at start, or two engines would each plan on memory only one of them can have.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    torch.cuda.empty_cache()  # blocks this process's torch keeps but no tensor uses
    baseline = CudaMemory.read(device)
    requested = int(baseline.total * gpu_memory_utilization)
    if requested > baseline.free:
        raise ConfigError(
            f"gpu_memory_utilization {gpu_memory_utilization:g} asks for "
            f"{_format_bytes(requested)} of {device} ({_format_bytes(baseline.total)}), but only "
            f"{_format_bytes(baseline.free)} is free: other processes or engines hold "
            f"{_format_bytes(baseline.total - baseline.free)}. Lower --gpu-memory-utilization "
            "or stop them"
        )
    return baseline


def engine_peak_bytes(baseline: CudaMemory, device: torch.device) -> int:
    """This engine's peak since ``baseline``: torch's peak allocation above what was allocated
    then (weights, activations, temporary buffers) plus memory outside torch it added since
    (communication buffers, library workspaces; the CUDA context already existed at the
    baseline). The caller resets torch's peak before the pass it measures."""
    now = CudaMemory.read(device)
    torch_peak = torch.cuda.max_memory_allocated(device) - baseline.allocated
    return max(0, torch_peak) + max(0, now.outside_torch - baseline.outside_torch)


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
    if device.type == "cpu" and huge_pages_enabled():
        return [zeros_on_huge_pages(shape, dtype) for _ in range(num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def attach_kv_caches(
    layers: list,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
) -> None:
    """Give every attention layer (the target model's, or a draft model's) its cache tensor of
    ``num_blocks`` blocks and the backend that reads it; the first layer's KV heads and head
    dim size them all."""
    first = layers[0]
    caches = allocate_kv_caches(
        len(layers), num_blocks, block_size, first.num_kv_heads, first.head_dim, dtype, device,
        backend,
    )  # fmt: skip
    for layer, cache in zip(layers, caches):
        layer.kv_cache = cache
        layer.backend = backend


def _format_bytes(num_bytes: float) -> str:
    if abs(num_bytes) >= 1 << 30:
        return f"{num_bytes / (1 << 30):.2f} GiB"
    return f"{num_bytes / (1 << 20):.2f} MiB"
