"""The compiled CPU attention kernel: that it builds and is used, its planning, its edge cases.

Its numerics on mixed batches are covered by test_attention.py, which runs every torch backend
test on both paths; here are the kernel's own concerns (head dims it specialises, strided queries,
thread counts, bad slots and block ids, the fallback builds, the build cache, the off switch).
"""

from __future__ import annotations

import platform
import threading

import numpy as np
import pytest
import torch

from conveyor.worker.attention import cpu_kernel
from conveyor.worker.attention.batch_plan import KernelRouting, plan_batch
from conveyor.worker.attention.cpu_kernel import PagedAttentionKernel, find_compiler, load_kernel
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from tests.worker.test_attention import (
    make_request,
    random_mixed_batch,
    reference_attention,
    run_torch_backend,
    slot_view,
    step_inputs,
    store_prefix,
)

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(load_kernel() is None, reason="the CPU kernel cannot be built")


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """Counts calls into the kernel made by any backend during the test."""
    calls = []
    attend = PagedAttentionKernel.attend

    def counting_attend(self, query, *args) -> None:
        calls.append(query.shape[0])
        attend(self, query, *args)

    monkeypatch.setattr(PagedAttentionKernel, "attend", counting_attend)
    return calls


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler on this machine")
@pytest.mark.skipif(cpu_kernel.kernel_disabled(), reason="CONVEYOR_CPU_KERNEL=0 is set")
def test_kernel_builds_and_the_default_backend_uses_it(kernel_calls):
    # With a compiler present a failed build is a bug, not a reason to fall back quietly.
    assert load_kernel() is not None
    requests, num_blocks = random_mixed_batch(0, 16, 8, 2)
    backend = TorchAttentionBackend()
    output, *_ = run_torch_backend(backend, requests, num_blocks, 16, 2)
    assert kernel_calls
    expected = torch.cat([reference_attention(r, 16**-0.5) for r in requests]).float()
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


def test_off_switch_keeps_the_torch_path(monkeypatch, kernel_calls):
    monkeypatch.setenv("CONVEYOR_CPU_KERNEL", "0")
    load_kernel.cache_clear()
    try:
        assert load_kernel() is None
        requests, num_blocks = random_mixed_batch(1, 16, 4, 2)
        backend = TorchAttentionBackend()
        output, *_ = run_torch_backend(backend, requests, num_blocks, 16, 2)
    finally:
        load_kernel.cache_clear()
    assert not kernel_calls and backend.cpu_kernel is None
    expected = torch.cat([reference_attention(r, 16**-0.5) for r in requests]).float()
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128, 80, 256])
@pytest.mark.parametrize("block_size", [16, 5])
def test_kernel_matches_reference_for_each_head_dim(kernel_calls, head_dim, block_size):
    # 64 and 128 are compiled as constants, other sizes through the generic loop.
    requests, num_blocks = random_mixed_batch(2, block_size, 8, 4, num_reqs=5, head_dim=head_dim)
    output, *_ = run_torch_backend(TorchAttentionBackend(), requests, num_blocks, block_size, 4)
    assert kernel_calls
    expected = torch.cat([reference_attention(r, head_dim**-0.5) for r in requests]).float()
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=1e-5)


@needs_kernel
def test_kernel_reads_a_query_that_is_a_view_into_a_fused_projection(kernel_calls):
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 16
    requests, num_blocks = random_mixed_batch(3, block_size, num_heads, num_kv_heads)
    kv_cache = torch.zeros(
        TorchAttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    )
    for r in requests:
        store_prefix(kv_cache, r, block_size)
    metadata, _, query, key, value = step_inputs(requests, block_size)
    # q, k, v side by side in one row per token, as a fused qkv linear produces them.
    fused = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q_view = fused[:, :q_size].view(-1, num_heads, head_dim)
    k_view = fused[:, q_size : q_size + kv_size].view(-1, num_kv_heads, head_dim)
    v_view = fused[:, q_size + kv_size :].view(-1, num_kv_heads, head_dim)
    assert not q_view.is_contiguous() and not k_view.is_contiguous()
    output = TorchAttentionBackend().forward(q_view, k_view, v_view, kv_cache, metadata, 0.25)
    assert kernel_calls
    expected = torch.cat([reference_attention(r, 0.25) for r in requests]).float()
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    slots = slot_view(kv_cache)[:, :, metadata.slot_mapping]
    torch.testing.assert_close(slots, torch.stack([key, value]).transpose(1, 2))


@needs_kernel
def test_kernel_output_does_not_depend_on_the_thread_count():
    requests, num_blocks = random_mixed_batch(4, 16, 8, 2, num_reqs=9)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            outputs.append(run_torch_backend(TorchAttentionBackend(), requests, num_blocks, 16, 2))
    finally:
        torch.set_num_threads(threads)
    # Each (item, kv head) pair is summed by one thread in one order: bitwise equal.
    assert torch.equal(outputs[0][0], outputs[1][0])


@needs_kernel
def test_kernel_refuses_a_slot_outside_the_cache():
    gen = torch.Generator().manual_seed(0)
    request = make_request(gen, 20, 1, 4, 2, [0, 1], torch.float32)
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(2, 16, 2, 16))
    metadata, _, query, key, value = step_inputs([request], 16)
    metadata.slot_mapping[:] = 32  # one past the last slot
    with pytest.raises(RuntimeError, match="slot out of range"):
        TorchAttentionBackend().forward(query, key, value, kv_cache, metadata, 0.25)
    assert torch.count_nonzero(kv_cache) == 0


@needs_kernel
def test_kernel_refuses_a_block_id_outside_the_cache():
    gen = torch.Generator().manual_seed(0)
    request = make_request(gen, 20, 1, 4, 2, [0, 1], torch.float32)
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(2, 16, 2, 16))
    metadata, _, query, key, value = step_inputs([request], 16)
    metadata.block_table[0, 1] = 2  # one past the last block
    metadata.slot_mapping[:] = 4  # keep the KV write itself in bounds
    with pytest.raises(RuntimeError, match="block id out of range"):
        TorchAttentionBackend().forward(query, key, value, kv_cache, metadata, 0.25)


@needs_kernel
@pytest.mark.parametrize("dtype,head_dim", [(torch.float64, 16), (torch.float32, 12)])
def test_what_the_kernel_cannot_run_takes_the_torch_path(kernel_calls, dtype, head_dim):
    # The kernel is float32 only, and works on 8-float vectors.
    gen = torch.Generator().manual_seed(5)
    request = make_request(gen, 30, 1, 4, 2, [1, 0], dtype, head_dim)
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(2, 16, 2, head_dim), dtype=dtype)
    store_prefix(kv_cache, request, 16)
    metadata, _, query, key, value = step_inputs([request], 16)
    output = TorchAttentionBackend().forward(query, key, value, kv_cache, metadata, 0.25)
    assert not kernel_calls
    expected = reference_attention(request, 0.25).to(dtype)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


def test_plan_tiles_every_query_into_items_longest_context_first():
    # Requests: a decode at ctx 50, a 10-token chunk after 30 cached, a 9-token prompt, a decode
    # at ctx 90.
    query_lens, seq_lens = np.array([1, 10, 9, 1]), np.array([50, 40, 9, 90], dtype=np.int32)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    plan = plan_batch(query_start_loc, seq_lens, 16, 1 << 20, CPU, kernel_routing=KernelRouting(4))
    assert plan.kernel_items.dtype == np.int32 and plan.kernel_items.flags.c_contiguous
    # (table row, first token, num queries, first position), most keys first.
    assert plan.kernel_items.tolist() == [
        [3, 20, 1, 89],
        [0, 0, 1, 49],
        [1, 9, 2, 38],
        [1, 5, 4, 34],
        [1, 1, 4, 30],
        [2, 19, 1, 8],
        [2, 15, 4, 4],
        [2, 11, 4, 0],
    ]
    assert plan.decode_chunks == [] and plan.prefill_requests == []


@pytest.mark.parametrize(
    "flags",
    [("-O3", "-fopenmp"), ("-O2",), ("-O3", "-mavx2", "-mfma", "-fopenmp")],
    ids=["portable", "plain", "avx2"],
)
def test_fallback_builds_compute_the_same_attention(tmp_path, monkeypatch, flags):
    # What a compiler that refuses -march=native or OpenMP builds must still be right; and the
    # build an AVX2 machine makes (8-float row vectors only, 16 registers), on this one.
    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    if "-mavx2" in flags and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 build")
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    backend = TorchAttentionBackend()
    backend.cpu_kernel = cpu_kernel._load(cpu_kernel._build(compiler, flags))
    requests, num_blocks = random_mixed_batch(6, 16, 8, 2, head_dim=64)
    output, *_ = run_torch_backend(backend, requests, num_blocks, 16, 2)
    expected = torch.cat([reference_attention(r, 64**-0.5) for r in requests]).float()
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=1e-5)


def test_concurrent_builds_publish_one_complete_library(tmp_path, monkeypatch):
    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    flags = ("-O1",)
    paths, errors = [], []

    def build() -> None:
        try:
            paths.append(cpu_kernel._build(compiler, flags))
        except Exception as error:  # surfaced by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(paths)) == 1
    folder = tmp_path / "kernels"
    assert sorted(p.name for p in folder.iterdir()) == [paths[0].name]  # no temporary files
    assert cpu_kernel._load(paths[0]).path == paths[0]
    # Other flags, another file; the same flags again, the same file untouched.
    mtime = paths[0].stat().st_mtime_ns
    assert cpu_kernel._build(compiler, ("-O2",)) != paths[0]
    assert cpu_kernel._build(compiler, flags) == paths[0]
    assert paths[0].stat().st_mtime_ns == mtime
