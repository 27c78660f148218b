"""The CPU KV cache on transparent huge pages (worker/host_memory.py)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from conveyor.protocol.config import ConfigError
from conveyor.worker import kv_cache
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from conveyor.worker.host_memory import HUGE_PAGE_BYTES, zeros_on_huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_available() -> bool:
    """Whether this kernel gives huge pages to a region that asks (``always`` or ``madvise``)."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return False
    return "[never]" not in text


def _anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_gives_a_zeroed_writable_tensor_of_the_shape_and_dtype():
    for dtype in (torch.float32, torch.bfloat16):
        x = zeros_on_huge_pages((2, 3, 70, 16, 8), dtype)
        assert x.shape == (2, 3, 70, 16, 8) and x.dtype == dtype and x.is_contiguous()
        assert torch.count_nonzero(x) == 0
        x[1, 2, 69, 15, 7] = 3.0
        assert x.sum().item() == 3.0
    assert zeros_on_huge_pages((0, 4), torch.float32).shape == (0, 4)


@pytest.mark.skipif(not _thp_available(), reason="this kernel has transparent huge pages off")
def test_the_memory_is_backed_by_huge_pages_and_released_with_the_tensor():
    before = _anon_huge_kib()
    x = zeros_on_huge_pages((16 * HUGE_PAGE_BYTES // 4,), torch.float32)
    assert x.data_ptr() % HUGE_PAGE_BYTES == 0
    # Every page was touched at allocation, so the kernel had to place huge pages then (it may
    # fall back to small ones when memory is too fragmented: most of them is the claim).
    assert _anon_huge_kib() - before >= 12 * HUGE_PAGE_BYTES // 1024
    view = x[HUGE_PAGE_BYTES // 4 :]
    del x
    gc.collect()
    assert _anon_huge_kib() - before >= 11 * HUGE_PAGE_BYTES // 1024  # a view keeps the mapping
    del view
    gc.collect()
    assert _anon_huge_kib() - before < 4 * HUGE_PAGE_BYTES // 1024


def test_cpu_kv_caches_take_huge_pages_unless_turned_off(monkeypatch):
    backend = TorchAttentionBackend()
    calls = []
    real = kv_cache.zeros_on_huge_pages
    monkeypatch.setattr(
        kv_cache,
        "zeros_on_huge_pages",
        lambda shape, dtype: calls.append(shape) or real(shape, dtype),
    )
    caches = kv_cache.allocate_kv_caches(
        2, 5, 16, 2, 8, torch.float32, torch.device("cpu"), backend
    )
    assert calls == [backend.kv_cache_shape(5, 16, 2, 8)] * 2
    assert all(torch.count_nonzero(c) == 0 for c in caches)
    monkeypatch.setenv("CONVEYOR_KV_HUGE_PAGES", "0")
    kv_cache.allocate_kv_caches(1, 5, 16, 2, 8, torch.float32, torch.device("cpu"), backend)
    assert len(calls) == 2


def test_a_huge_pages_setting_it_does_not_know_is_refused(monkeypatch):
    for value, enabled in (("1", True), ("on", True), ("0", False), ("Off", False)):
        monkeypatch.setenv("CONVEYOR_KV_HUGE_PAGES", value)
        assert kv_cache.huge_pages_enabled() is enabled
    monkeypatch.setenv("CONVEYOR_KV_HUGE_PAGES", "disabled")
    with pytest.raises(ConfigError, match="CONVEYOR_KV_HUGE_PAGES='disabled': use one of"):
        kv_cache.allocate_kv_caches(
            1, 5, 16, 2, 8, torch.float32, torch.device("cpu"), TorchAttentionBackend()
        )


def _one_storage(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _kernel_copies(model) -> list[torch.Tensor]:
    return [
        tensor
        for module in model.modules()
        for value in vars(module).values()
        if hasattr(value, "weight_tensors") and not isinstance(value, torch.nn.Module)
        for _, _, tensor in value.weight_tensors()
    ]


@pytest.mark.parametrize("quantization", [None, "int4", "int8"])
def test_weights_move_to_one_huge_page_mapping_with_their_values(tiny_model_dirs, quantization):
    from conveyor.worker.host_memory import place_weights_on_huge_pages
    from conveyor.worker.loader import load_model

    model = load_model(tiny_model_dirs["qwen3"], torch.float32, "cpu", quantization=quantization)
    params = dict(model.named_parameters())
    values = {name: p.detach().clone() for name, p in params.items()}
    copies = [t.clone() for t in _kernel_copies(model)]
    assert bool(copies) == (quantization is not None)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # The tiny model fits in the caches: moved only when asked to move any size.
    assert place_weights_on_huge_pages(model) == 0
    assert place_weights_on_huge_pages(model, min_bytes=0) > 0
    # Every parameter and kernel copy is a view of one mapping, holding what it held.
    # (The float weights int8 replaced stay on the meta device: shapes only, nothing to move.)
    moved = [t for t in (*model.parameters(), *_kernel_copies(model)) if t.device.type != "meta"]
    assert len(_one_storage(moved)) == 1
    assert all(
        torch.equal(p, values[name])
        for name, p in model.named_parameters()
        if p.device.type != "meta"
    )
    assert all(torch.equal(a, b) for a, b in zip(_kernel_copies(model), copies))
    if tied:  # a tied embedding and LM head still share their memory
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_a_weight_huge_pages_setting_it_does_not_know_is_refused(monkeypatch):
    monkeypatch.setenv("CONVEYOR_WEIGHT_HUGE_PAGES", "sometimes")
    with pytest.raises(ConfigError, match="CONVEYOR_WEIGHT_HUGE_PAGES"):
        kv_cache.weight_huge_pages_enabled()
    monkeypatch.setenv("CONVEYOR_WEIGHT_HUGE_PAGES", "0")
    assert not kv_cache.weight_huge_pages_enabled()
