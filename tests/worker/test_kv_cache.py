"""KV cache sizing arithmetic, its errors, and per-layer allocation."""

from __future__ import annotations

import pytest
import torch

from conveyor.protocol.config import ConfigError
from conveyor.worker.attention.flash_attn_backend import FlashAttnBackend
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from conveyor.worker.kv_cache import (
    allocate_kv_caches,
    claim_cuda_memory,
    engine_peak_bytes,
    gpu_memory_utilization,
    kv_bytes_per_block,
    num_blocks_for_cuda,
    num_blocks_for_memory,
)

GIB = 1 << 30


def test_bytes_per_block_counts_keys_and_values_of_every_layer():
    # 2 (K and V) * 8 layers * 16 tokens * 4 heads * 64 dims * 4 bytes.
    assert kv_bytes_per_block(8, 16, 4, 64, torch.float32) == 2 * 8 * 16 * 4 * 64 * 4 == 262144
    assert kv_bytes_per_block(8, 16, 4, 64, torch.bfloat16) == 131072
    assert kv_bytes_per_block(1, 256, 2, 128, torch.float16) == 2 * 256 * 2 * 128 * 2


def test_num_blocks_rounds_down():
    assert num_blocks_for_memory(GIB, 262144) == 4096
    assert num_blocks_for_memory(GIB - 1, 262144) == 4095
    assert num_blocks_for_memory(2 * 262144, 262144) == 2


def test_too_little_memory_names_what_one_block_needs():
    with pytest.raises(ConfigError, match=r"one block needs 262144 bytes \(0\.25 MiB\)"):
        num_blocks_for_memory(2 * 262144 - 1, 262144)
    with pytest.raises(ConfigError, match="holds 0 blocks"):
        num_blocks_for_memory(-5, 262144)


def test_cuda_blocks_are_utilization_of_total_minus_profiled_peak():
    # 80 GiB at 90% is 72 GiB; the profiling pass peaked at 20 GiB: 52 GiB of 2 MiB blocks.
    assert num_blocks_for_cuda(80 * GIB, 20 * GIB, 0.9, 2 << 20) == 52 * 512
    assert num_blocks_for_cuda(80 * GIB, 20 * GIB, 0.5, 2 << 20) == 20 * 512


def test_a_set_kv_cache_memory_is_the_cuda_cache_size_when_the_share_holds_it():
    # The share leaves 52 GiB; 1 GiB asked for is 512 blocks of 2 MiB, not 52 GiB's worth.
    assert num_blocks_for_cuda(80 * GIB, 20 * GIB, 0.9, 2 << 20, kv_cache_memory=GIB) == 512
    assert num_blocks_for_cuda(80 * GIB, 20 * GIB, 0.9, 2 << 20, kv_cache_memory=52 * GIB) == (
        52 * 512
    )
    with pytest.raises(
        ConfigError, match=r"kv_cache_memory 53\.00 GiB does not fit.*leaves 52\.00 GiB"
    ):
        num_blocks_for_cuda(80 * GIB, 20 * GIB, 0.9, 2 << 20, kv_cache_memory=53 * GIB)
    with pytest.raises(ConfigError, match="holds 0 blocks"):
        num_blocks_for_cuda(80 * GIB, 20 * GIB, 0.9, 2 << 20, kv_cache_memory=GIB >> 12)


def test_gpu_memory_utilization_is_a_cuda_share_and_refused_on_cpu():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert gpu_memory_utilization(None, cuda) == 0.9
    assert gpu_memory_utilization(0.4, cuda) == 0.4
    assert gpu_memory_utilization(None, cpu) is None
    with pytest.raises(
        ConfigError, match=r"gpu_memory_utilization 0\.5 applies to CUDA.*--kv-cache-memory"
    ):
        gpu_memory_utilization(0.5, cpu)


def test_cuda_errors_when_the_peak_leaves_no_room():
    with pytest.raises(ConfigError, match="profiling pass peaked at 75.00 GiB"):
        num_blocks_for_cuda(80 * GIB, 75 * GIB, 0.9, 2 << 20)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        num_blocks_for_cuda(80 * GIB, GIB, 1.5, 2 << 20)


class _FakeDevice:
    """torch.cuda's memory queries over numbers a test sets (the accounting runs on CPU)."""

    def __init__(self, monkeypatch, total: int) -> None:
        self.total, self.used_elsewhere = total, 0
        self.allocated = self.reserved = self.peak = 0
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device: (self.free(), self.total))
        monkeypatch.setattr(cuda, "memory_allocated", lambda device: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device: self.reserved)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device: self.peak)

    def free(self) -> int:
        return self.total - self.used_elsewhere - self.reserved

    def allocate(self, size: int) -> None:
        self.allocated += size
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)


def test_an_engine_counts_only_its_own_memory_against_its_share(monkeypatch):
    device = _FakeDevice(monkeypatch, 80 * GIB)
    # Another process holds 20 GiB and this process an earlier engine's 10 GiB.
    device.used_elsewhere = 20 * GIB
    device.allocate(10 * GIB)
    baseline = claim_cuda_memory(torch.device("cuda"), 0.5)
    device.allocate(3 * GIB)  # weights
    device.allocate(2 * GIB)  # the profiling pass's activations, freed after
    device.allocated -= 2 * GIB
    device.used_elsewhere += GIB // 2  # this engine's CUDA context
    peak = engine_peak_bytes(baseline, torch.device("cuda"))
    assert peak == 5 * GIB + GIB // 2
    assert num_blocks_for_cuda(baseline.total, peak, 0.5, 2 << 20) == int(34.5 * 512)


def test_a_share_that_is_not_free_at_start_is_refused_with_the_numbers(monkeypatch):
    device = _FakeDevice(monkeypatch, 80 * GIB)
    device.used_elsewhere = 50 * GIB
    with pytest.raises(ConfigError, match=r"asks for 40.00 GiB .* only 30.00 GiB is free"):
        claim_cuda_memory(torch.device("cuda"), 0.5)
    assert claim_cuda_memory(torch.device("cuda"), 0.3).free == 30 * GIB
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        claim_cuda_memory(torch.device("cuda"), 0.0)


def test_allocation_gives_one_zeroed_tensor_per_layer_in_the_backend_layout():
    backend = TorchAttentionBackend()
    caches = allocate_kv_caches(3, 5, 16, 2, 8, torch.float32, torch.device("cpu"), backend)
    assert len(caches) == 3
    for cache in caches:
        assert cache.shape == backend.kv_cache_shape(5, 16, 2, 8)
        assert cache.dtype == torch.float32
        assert torch.count_nonzero(cache) == 0
    caches[0].fill_(1.0)
    assert torch.count_nonzero(caches[1]) == 0  # layers do not share storage
    bytes_allocated = sum(c.numel() * c.element_size() for c in caches)
    assert bytes_allocated == 5 * kv_bytes_per_block(3, 16, 2, 8, torch.float32)


def test_allocation_refuses_a_block_size_the_backend_cannot_page():
    with pytest.raises(ConfigError, match="does not support block_size 16"):
        allocate_kv_caches(1, 4, 16, 2, 8, torch.bfloat16, torch.device("cpu"), FlashAttnBackend())
