"""The compiled CPU kernel's bfloat16 build: bfloat16 queries, cache and output, float32 inside.

The reference is the float32 kernel on the same values (the bfloat16 inputs widened, exactly): the
bfloat16 build must give that result rounded once to bfloat16, so every output element is within
half a bfloat16 step of it (plus float32 noise). The float32 kernel is itself checked against the
torch path and dense float64 attention (test_prefill_kernel.py, test_attention.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conveyor.frontend.engine_args import EngineArgs
from conveyor.worker.attention.cpu_kernel import PagedAttentionKernel, load_kernel
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from conveyor.worker.model_runner import ModelRunner
from tests.devices import logprob_tolerance
from tests.worker.test_attention import Request, step_inputs, store_prefix
from tests.worker.test_cuda import _prompts, logprob_error, teacher_forced_logprobs
from tests.worker.test_prefill_kernel import BLOCK_SIZE, make_batch

pytestmark = pytest.mark.skipif(
    load_kernel(torch.bfloat16) is None, reason="the CPU kernel cannot be built"
)
# Round to nearest: at most half of bfloat16's 2^-7 relative step, with room for float32 noise
# that moves a value across a rounding boundary.
BF16_RTOL = 2**-8 + 1e-5


def as_dtype(requests: list[Request], dtype: torch.dtype) -> list[Request]:
    return [
        dataclasses.replace(
            r, keys=r.keys.to(dtype), values=r.values.to(dtype), query=r.query.to(dtype)
        )
        for r in requests
    ]


def run_step(requests, num_blocks, dtype, kv_dtype=None, use_cpu_kernel=True, **layer):
    """(output, cache after the step, the (dtype, kv_dtype) of each kernel call) of one step of
    ``dtype`` queries over a ``kv_dtype`` cache (default: ``dtype``), the cached prefixes stored
    as that cache holds them."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    num_kv_heads, head_dim = requests[0].keys.shape[1:]
    shape = TorchAttentionBackend.kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    kv_cache = torch.zeros(shape, dtype=kv_dtype)
    for r in requests:
        cached = dataclasses.replace(r, keys=r.keys.to(kv_dtype), values=r.values.to(kv_dtype))
        store_prefix(kv_cache, cached, BLOCK_SIZE)
    metadata, _, query, key, value = step_inputs(requests, BLOCK_SIZE)
    backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel)
    calls = []
    original = PagedAttentionKernel.attend

    def counting(self, *args, **kwargs):
        calls.append((self.dtype, self.kv_dtype))
        original(self, *args, **kwargs)

    PagedAttentionKernel.attend = counting
    try:
        output = backend.forward(query, key, value, kv_cache, metadata, head_dim**-0.5, **layer)
    finally:
        PagedAttentionKernel.attend = original
    assert output.dtype == dtype
    return output, kv_cache, calls


def run_kernel(requests: list[Request], num_blocks: int, dtype: torch.dtype, **layer):
    """(output, cache after the step) of the kernel path in ``dtype``."""
    output, kv_cache, calls = run_step(requests, num_blocks, dtype, **layer)
    assert calls == [(dtype, dtype)], "the step did not go through the compiled kernel"
    return output, kv_cache


def assert_rounded_from(bf16_out: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(bf16_out.float(), reference, rtol=BF16_RTOL, atol=1e-6)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_mixed_step_is_the_float32_result_rounded(num_heads, num_kv_heads, head_dim):
    # Decodes and prompt chunks of several lengths (short items and query tiles), after cached
    # prefixes on and off block boundaries.
    shapes = [(300, 1), (45, 300), (0, 130), (17, 1), (64, 64), (5, 3), (37, 1000)]
    requests, num_blocks = make_batch(
        7 + head_dim + num_heads, shapes, num_heads, num_kv_heads, head_dim
    )
    bf16 = as_dtype(requests, torch.bfloat16)
    out_bf16, cache_bf16 = run_kernel(bf16, num_blocks, torch.bfloat16)
    out_fp32, cache_fp32 = run_kernel(as_dtype(bf16, torch.float32), num_blocks, torch.float32)
    assert_rounded_from(out_bf16, out_fp32)
    # The step's keys and values were stored bit for bit.
    assert torch.equal(cache_bf16.float(), cache_fp32)


@pytest.mark.parametrize(
    "window,with_sinks,softcap",
    [(100, False, None), (None, True, None), (None, False, 30.0), (5, True, 30.0)],
    ids=["window", "sinks", "softcap", "all-three"],
)
def test_windows_sinks_and_softcaps(window, with_sinks, softcap):
    shapes = [(37, 500), (250, 1), (0, 40)]
    requests, num_blocks = make_batch(11, shapes, 8, 2, 64)
    # Sinks stay float32 (one logit per head, as the models keep them).
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)) if with_sinks else None
    layer = {"sliding_window": window, "sinks": sinks, "softcap": softcap}
    bf16 = as_dtype(requests, torch.bfloat16)
    out_bf16, _ = run_kernel(bf16, num_blocks, torch.bfloat16, **layer)
    out_fp32, _ = run_kernel(as_dtype(bf16, torch.float32), num_blocks, torch.float32, **layer)
    assert_rounded_from(out_bf16, out_fp32)


def test_the_bfloat16_build_is_closer_to_exact_than_the_torch_bfloat16_path():
    """What the build is for: float32 arithmetic inside, one rounding at the end. The torch path
    in bfloat16 rounds its scores and weights along the way."""
    requests, num_blocks = make_batch(5, [(500, 1), (100, 200), (0, 64)], 8, 2, 64)
    bf16 = as_dtype(requests, torch.bfloat16)
    exact, _ = run_kernel(as_dtype(bf16, torch.float32), num_blocks, torch.float32)
    kernel_out, _ = run_kernel(bf16, num_blocks, torch.bfloat16)
    num_kv_heads, head_dim = requests[0].keys.shape[1:]
    shape = TorchAttentionBackend.kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    kv_cache = torch.zeros(shape, dtype=torch.bfloat16)
    for r in bf16:
        store_prefix(kv_cache, r, BLOCK_SIZE)
    metadata, _, query, key, value = step_inputs(bf16, BLOCK_SIZE)
    torch_out = TorchAttentionBackend(use_cpu_kernel=False).forward(
        query, key, value, kv_cache, metadata, head_dim**-0.5
    )
    kernel_error = (kernel_out.float() - exact).abs().max().item()
    torch_error = (torch_out.float() - exact).abs().max().item()
    assert kernel_error <= torch_error, (kernel_error, torch_error)


def test_other_dtypes_have_no_build():
    assert load_kernel(torch.float16) is None
    kernel = load_kernel(torch.bfloat16)
    query = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(4, 16, 2, 64), dtype=torch.bfloat16)
    assert kernel.supports(query, cache)
    assert not kernel.supports(query.float(), cache.float())  # the float32 build's
    assert not load_kernel(torch.float32).supports(query, cache)


def test_a_bfloat16_model_on_the_kernel_is_as_close_to_float32_as_on_torch_ops(tiny_model_dir):
    """The whole tiny Qwen3, a prefill step and a decode step on the same tokens (teacher forced,
    full vocabulary): the bfloat16 run through the compiled kernels within twice the torch-ops
    bfloat16 run's distance from the float32 run (or the bfloat16 tolerance, if larger)."""
    prompts = _prompts(4, vocab=1000, seed=3)
    next_tokens = [17, 404, 250, 777]
    runs = {}
    for backend, dtype in (("torch", "float32"), ("torch", "bfloat16"), ("cpu-kernel", "bfloat16")):
        config = EngineArgs(
            model=str(tiny_model_dir), device="cpu", dtype=dtype, attention_backend=backend,
            max_num_seqs=8, max_model_len=256, block_size=16, kv_cache_memory=16 << 20,
        ).create_engine_config()  # fmt: skip
        runner = ModelRunner(config, torch.device("cpu"))
        runner.initialize_cache(runner.determine_num_blocks())
        runs[backend, dtype] = teacher_forced_logprobs(runner, prompts, next_tokens)
        if backend == "cpu-kernel":
            assert runner.backend.cpu_kernel.dtype == torch.bfloat16  # the bfloat16 build ran
        runner.release()
    reference = runs["torch", "float32"]
    torch_error = logprob_error(runs["torch", "bfloat16"], reference)
    kernel_error = logprob_error(runs["cpu-kernel", "bfloat16"], reference)
    print(
        f"bfloat16 vs float32 logprob error: torch ops {torch_error:.4f}, kernel {kernel_error:.4f}"
    )
    assert np.isfinite(torch_error) and np.isfinite(kernel_error)
    assert kernel_error <= max(2 * torch_error, logprob_tolerance("bfloat16")), (
        kernel_error,
        torch_error,
    )
